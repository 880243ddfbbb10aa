"""Prediction from a trained model: turn raw inputs (image files, .npy/.npz arrays, CSV rows,
text lines) into model inputs exactly as training did (using the preprocessing saved with the
weights) and return what the model's task means by a prediction: class probabilities, label
probabilities, or values (:mod:`glassloop.tasks`). :class:`Inputs` does all of it but running
the model, in numpy alone (``glassloop predict model.onnx`` imports no torch); the
:class:`Predictor` runs the PyTorch model."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from glassloop.data.raw_files import (
    IMAGE_SUFFIXES,
    is_float,
    load_arrays,
    open_image,
    read_csv_rows,
)
from glassloop.errors import DataError
from glassloop.storage.atomic import atomic_path, open_own

if TYPE_CHECKING:
    import torch
    from torch import nn

    from glassloop.tools.export import ModelClass

# The tasks whose outputs are values, one per output (glassloop.tasks, which imports torch):
# every other task's outputs are probabilities of classes, ranked by top_k.
VALUE_TASKS = ("multilabel", "regression", "custom")

# How far (in training standard deviations) an input's mean may be from the training mean
# before predict warns: per-image means of MNIST digits stay within about 1 of it.
UNUSUAL_MEAN = 1.5


@dataclass
class Prediction:
    """One input's prediction: the top-k classes with their probabilities (classification),
    every label with its probability (multilabel), or every output with its value
    (regression)."""

    source: str
    classes: list[str]
    probabilities: list[float]  # for a regression: the predicted values
    values: bool = False  # a regression's values, not probabilities


class Inputs:
    """What a model's description (``glassloop.model``: input shape, preprocessing, task,
    classes) says about reading raw inputs and its outputs; :meth:`outputs` runs the model."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.input_shape = tuple(int(d) for d in spec["input_shape"])
        self.class_names: list[str] = list(spec.get("class_names") or [])
        self.preprocessing: dict[str, Any] = dict(spec.get("preprocessing") or {})
        self.task: str = spec.get("task", "classification")
        self.warnings: list[str] = []  # inputs far from the training data (see unusual)

    def outputs(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The task's prediction (:func:`glassloop.predict`) for a batch of model inputs:
        ``{"input": x}``, or a text model's ``input_ids``, ``attention_mask``, ``lengths``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ raw → model inputs
    def prepare(self, x: Any) -> np.ndarray:
        """Raw values (pixels 0-255, CSV units) → normalised model inputs, batch dimension
        added to a single example; token ids stay integers."""
        if self.preprocessing.get("inputs") == "token_ids":
            ids = np.asarray(x, dtype=np.int64)
            return ids[None] if ids.ndim == len(self.input_shape) else ids
        t = np.asarray(x, dtype=np.float32)
        single_channel = len(self.input_shape) == 3 and self.input_shape[0] == 1
        if tuple(t.shape) == self.input_shape:
            t = t[None]
        elif single_channel and t.ndim in (2, 3) and tuple(t.shape[-2:]) == self.input_shape[1:]:
            t = t.reshape(-1, *self.input_shape)  # grayscale (H, W) or (N, H, W): add channel
        elif tuple(t.shape[1:]) != self.input_shape:
            flat = int(np.prod(self.input_shape))
            if t.ndim >= 1 and t.shape[-1] == flat and t.size % flat == 0:
                t = t.reshape(-1, *self.input_shape)  # flattened rows of the right size
            else:
                shape = ", ".join(map(str, self.input_shape))
                raise DataError(
                    f"predict: input of shape {tuple(t.shape)} does not fit the model's input "
                    f"({shape}) (one example) or (N, {shape})"
                )
        if not bool(np.isfinite(t).all()):
            raise DataError("predict: the input holds NaN or inf values; clean it first")
        p = self.preprocessing
        if "scale" in p:
            t = t * np.float32(p["scale"])
        if "mean" in p and "std" in p:
            mean = np.asarray(p["mean"], dtype=np.float32)
            std = np.asarray(p["std"], dtype=np.float32)
            if t.ndim == 4:  # per channel
                mean, std = mean[None, :, None, None], std[None, :, None, None]
            t = (t - mean) / std
        return t

    def read_image(self, path: Path) -> np.ndarray:
        """An image file's pixels in the raw units of the training data (what :meth:`prepare`
        takes): pixels for image data sets, 0-16 for ``digits``. A model trained on arrays
        with no known pixel scale (npz, csv) refuses images rather than guess one."""
        if len(self.input_shape) != 3:
            raise DataError(f"predict: '{path}' is an image but the model takes {self.input_shape}")
        p = self.preprocessing
        # (Weights written before "image_to_raw" existed: their scaled sources were images.)
        to_raw = p.get("image_to_raw", 1.0 if "scale" in p else None)
        if to_raw is None:
            raise DataError(
                f"predict: '{path}' is an image, but this model was trained on arrays that "
                "glassloop did not read from images, so how its pixels map to the training "
                "values is unknown; convert the image as the training data was converted and "
                "pass a .npy file"
            )
        channels, height, width = self.input_shape
        with open_image(path, "predict") as opened:
            image = opened.convert("L" if channels == 1 else "RGB").resize((width, height))
        pixels = np.asarray(image, dtype=np.float32) * np.float32(to_raw)
        return pixels.reshape(height, width, channels).transpose(2, 0, 1)

    def read_csv(self, path: Path) -> tuple[np.ndarray, list[str]]:
        columns = self.preprocessing.get("feature_columns")
        rows = read_csv_rows(path)
        if not rows:
            raise DataError(f"predict: '{path}' is empty")
        # A first row with a value that is not a number is a header (names); one of numbers
        # is the first input: never dropped (it once was, silently; and with an empty cell).
        named = any(cell.strip() and not is_float(cell) for cell in rows[0])
        header, body = (rows[0], rows[1:]) if named else ([], rows)
        if columns and set(columns) <= set(header):
            index = [header.index(c) for c in columns]
        else:
            width = len(rows[0])
            index = list(range(width))
            expected = int(np.prod(self.input_shape))
            if width != expected:
                raise DataError(
                    f"predict: '{path}' has {width} columns, the model takes {expected} "
                    f"features{' (' + ', '.join(columns) + ')' if columns else ''}"
                    f"{'' if named else ' (its first row is numbers: no header)'}"
                )
        first = 2 if named else 1  # (names are the file's line numbers; blank lines skipped)
        lines = [(n, row) for n, row in enumerate(body, first) if any(c.strip() for c in row)]
        try:
            values = np.array([[float(row[i]) for i in index] for _, row in lines], np.float32)
        except (ValueError, IndexError):
            fits = [
                len(row) > max(index) and all(is_float(row[i]) for i in index) for _, row in lines
            ]
            bad = lines[fits.index(False)][0]
            raise DataError(
                f"predict: '{path}' line {bad} has a non-numeric or missing value"
            ) from None
        return values.reshape(len(lines), len(index)), [f"{path.name}:{n}" for n, _ in lines]

    # ------------------------------------------------------------------------- prediction
    def predict_arrays(self, x: Any, names: list[str] | None = None) -> np.ndarray:
        """The task's prediction for raw inputs (see :meth:`prepare`); inputs far from the
        training data are named in :attr:`warnings`."""
        prepared = self.prepare(x)
        for index in self.unusual(prepared):
            name = names[index] if names and index < len(names) else f"input {index}"
            mean = float(prepared[index].astype(np.float64).mean())
            self.warnings.append(
                f"warning: {name} is far from the training data (mean {mean:.2f} after the "
                f"training preprocessing; {self._usual_mean()}): the prediction is "
                "unreliable (inverted colours? other units?)"
            )
        return self.outputs({"input": prepared})

    def unusual(self, prepared: np.ndarray) -> list[int]:
        """Inputs whose mean, after the training split's standardisation, is more than
        ``UNUSUAL_MEAN`` from 0 (training inputs average 0 there; an inverted MNIST digit
        averages about 2.4); for data that is not standardised, whose mean lies outside the
        range of the training inputs' means by more than half that range."""
        if prepared.dtype.kind != "f" or not len(prepared):
            return []
        means = prepared.reshape(len(prepared), -1).mean(axis=1)
        if "mean" in self.preprocessing:
            return [int(i) for i in np.flatnonzero(np.abs(means) > UNUSUAL_MEAN)]
        if "example_means" not in self.preprocessing:
            return []
        low, high = (float(v) for v in self.preprocessing["example_means"])
        margin = max(high - low, 1e-6) / 2
        return [int(i) for i in np.flatnonzero((means < low - margin) | (means > high + margin))]

    def _usual_mean(self) -> str:
        if "mean" in self.preprocessing:
            return "training inputs average 0 there"
        low, high = self.preprocessing["example_means"]
        return f"training inputs average {low:.2f} to {high:.2f}"

    def predict_texts(self, texts: list[str]) -> np.ndarray:
        """Each text tokenized by the tokenizer saved with the model, cut to its
        ``max_length``, padded with ``pad_id`` (as ``glassloop.data.pad_collate`` pads)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(self.preprocessing["tokenizer"])
        pad_id = int(self.spec.get("pad_id", 0))
        limit = int(self.preprocessing.get("max_length", 256))
        ids = [(e.ids or [pad_id])[:limit] for e in tokenizer.encode_batch(texts)]
        lengths = np.array([len(i) for i in ids], dtype=np.int64)
        padded = np.full((len(ids), int(lengths.max())), pad_id, dtype=np.int64)
        for row, sequence in zip(padded, ids, strict=True):
            row[: len(sequence)] = sequence
        mask = (np.arange(padded.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
        return self.outputs({"input_ids": padded, "attention_mask": mask, "lengths": lengths})

    def predict_files(self, paths: list[str | Path]) -> tuple[list[str], np.ndarray]:
        """Read every file (images, .npy/.npz, .csv, text lines) and predict; returns one
        source label per prediction and the probabilities."""
        sources: list[str] = []
        outputs: list[np.ndarray] = []
        images: list[np.ndarray] = []
        image_names: list[str] = []
        for raw in paths:
            path = Path(raw)
            if not path.is_file():
                raise DataError(f"predict: input '{path}' not found")
            suffix = path.suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                images.append(self.read_image(path))
                image_names.append(str(path))
            elif suffix in (".npy", ".npz"):
                arrays = load_arrays(path, "predict")
                if not arrays:
                    raise DataError(f"predict: '{path}' holds no arrays")
                values = next(iter(arrays.values()))
                names = [f"{path.name}[{i}]" for i in range(len(self.prepare(values)))]
                outputs.append(self.predict_arrays(values, names))
                sources += names
            elif suffix == ".csv":
                values, names = self.read_csv(path)
                outputs.append(self.predict_arrays(values, names))
                sources += names
            elif "tokenizer" in self.preprocessing:
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(
                        f"predict: '{path}' is not UTF-8 text (byte {err.start})"
                    ) from err
                lines = [line for line in text.splitlines() if line.strip()]
                if not lines:
                    raise DataError(f"predict: '{path}' holds no text (every line is blank)")
                outputs.append(self.predict_texts(lines))
                sources += [f"{path.name}:{i}" for i in range(1, len(lines) + 1)]
            else:
                raise DataError(
                    f"predict: cannot tell how to read '{path}' (images, .npy, .npz, .csv, or "
                    "text lines for a text model)"
                )
        if images:
            outputs.insert(0, self.predict_arrays(np.stack(images), image_names))
            sources = image_names + sources
        return sources, np.concatenate(outputs) if outputs else np.empty(0, np.float32)

    def top_k(self, sources: list[str], probs: Any, k: int) -> list[Prediction]:
        """Per input: the ``k`` likeliest classes (classification); every label or output
        (multilabel, regression: ``k`` does not apply)."""
        probs = np.asarray(probs)
        if self.task in VALUE_TASKS:
            outputs = range(probs.shape[1])
            names = [self.class_names[i] if i < len(self.class_names) else str(i) for i in outputs]
            return [
                Prediction(
                    source,
                    names,
                    [round(float(v), 6) for v in row],
                    values=self.task != "multilabel",
                )
                for source, row in zip(sources, probs.reshape(len(sources), -1), strict=True)
            ]
        if probs.ndim == 3:  # a language model: the next token, after the last position
            probs = probs[:, -1, :]
        k = min(k, probs.shape[1])
        indices = np.argsort(-probs, axis=1, kind="stable")[:, :k]  # (ties: the lower index)
        values = np.take_along_axis(probs, indices, axis=1)
        names = self.class_names
        return [
            Prediction(
                source,
                [names[i] if i < len(names) else str(i) for i in idx.tolist()],
                [round(float(v), 6) for v in vals],
            )
            for source, vals, idx in zip(sources, values, indices, strict=True)
        ]


class Predictor(Inputs):
    """A trained PyTorch model plus what it needs to read raw inputs.

    >>> # predictor = Predictor.from_path("runs/demo")          # run dir, checkpoint or file
    >>> # predictor.predict(torch.rand(28, 28) * 255)           # one raw image: batch added
    """

    def __init__(self, model: nn.Module, spec: dict[str, Any]) -> None:
        super().__init__(spec)
        self.model = model.eval()

    @classmethod
    def from_path(
        cls, path: str | Path, *, model_class: ModelClass | None = None, trust_code: bool = False
    ) -> Predictor:
        """A run directory, a checkpoint directory or an exported ``.safetensors`` file;
        ``model_class`` / ``trust_code`` as in :func:`glassloop.load_model`."""
        from glassloop.tools.export import model_description, model_from, read_weights

        weights = read_weights(path)
        spec = model_description(weights)
        return cls(model_from(weights, spec, model_class, trust_code), spec)

    def outputs(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        from glassloop.evaluation.evaluate import predict

        if "input" in inputs:
            x, classes = torch.from_numpy(inputs["input"]), int(self.spec["num_classes"])
            return predict(self.model, x, task=self.task, classes=classes).numpy()
        batch = {key: torch.from_numpy(value) for key, value in inputs.items()}  # (a text's)
        return predict(self.model, [batch], task=self.task).numpy()

    def predict(self, x: np.ndarray | torch.Tensor, names: list[str] | None = None) -> torch.Tensor:
        """The task's prediction for raw inputs (see :meth:`prepare`); inputs far from the
        training data are named in :attr:`warnings`."""
        import torch

        return torch.from_numpy(self.predict_arrays(np.asarray(x), names))

    def predict_files(self, paths: list[str | Path]) -> tuple[list[str], Any]:
        """Read every file (images, .npy/.npz, .csv, text lines) and predict; one source
        label per prediction and the probabilities (a tensor)."""
        import torch

        sources, outputs = super().predict_files(paths)
        return sources, torch.from_numpy(outputs)


def write_predictions(predictions: list[Prediction], path: Path) -> None:
    """CSV: input, rank, class, probability (one row per input and rank; for a regression:
    input, rank (the output's position), output, value)."""
    values = bool(predictions) and predictions[0].values
    with atomic_path(path) as tmp, open_own(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["input", "rank", "output", "value"]
            if values
            else ["input", "rank", "class", "probability"]
        )
        for p in predictions:
            for rank, (name, prob) in enumerate(zip(p.classes, p.probabilities, strict=True), 1):
                writer.writerow([p.source, rank, name, prob])


def format_predictions(predictions: list[Prediction]) -> str:
    def shown(p: Prediction, q: float) -> str:
        return f"{q:.6g}" if p.values else f"{100 * q:.2f}%"

    return "\n".join(
        f"{p.source}: "
        + ", ".join(f"{c} {shown(p, q)}" for c, q in zip(p.classes, p.probabilities, strict=True))
        for p in predictions
    )


__all__ = ["Prediction", "Predictor", "format_predictions", "write_predictions"]
