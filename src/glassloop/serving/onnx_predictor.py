"""``glassloop predict model.onnx INPUTS``: an ONNX file that ``glassloop export`` wrote, run
by onnxruntime on raw inputs read as ``glassloop predict RUN`` reads them (the file's own
description of its inputs, :class:`glassloop.tools.prediction.Inputs`), with numpy alone:
nothing on this path imports torch (``tests/serving/test_export.py`` runs it with torch
made unimportable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from glassloop.errors import GlassloopError
from glassloop.tools.prediction import Inputs

METADATA = "glassloop.model"  # the ONNX metadata key holding the model's description
TOKEN_INPUTS = ("input_ids", "attention_mask")  # a text model's: the file's fixed length


def require_onnxruntime() -> Any:
    """onnxruntime, or one line naming the extra that installs it."""
    try:
        import onnxruntime
    except ImportError:
        raise GlassloopError(
            "onnx: onnxruntime is not installed; install it with pip install 'glassloop[export]'"
        ) from None
    return onnxruntime


class OnnxPredictor(Inputs):
    """An ONNX file and the description ``glassloop export`` put in its metadata."""

    def __init__(self, path: str | Path) -> None:
        onnxruntime = require_onnxruntime()
        try:
            self.session = onnxruntime.InferenceSession(
                str(path), providers=["CPUExecutionProvider"]
            )
        except Exception as err:  # (onnxruntime's own errors: not a file it can run)
            raise GlassloopError(
                f"predict: '{path}' is not an ONNX file onnxruntime runs: {err}"
            ) from None
        spec = self.session.get_modelmeta().custom_metadata_map.get(METADATA)
        try:
            description = checked(json.loads(spec or ""))
        except (ValueError, KeyError, TypeError, RecursionError) as err:
            raise GlassloopError(
                f"predict: '{path}' does not describe its inputs (no usable {METADATA!r} "
                f"metadata: {err}); export it with glassloop export --format onnx"
            ) from None
        super().__init__(description)

    def outputs(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The file's output (the task's prediction: its activation is inside the file)."""
        feed = {}
        for value in self.session.get_inputs():
            if value.name not in inputs:
                raise GlassloopError(
                    f"predict: the file takes {value.name!r}; these inputs give {sorted(inputs)}"
                )
            given, length = inputs[value.name], value.shape[1] if len(value.shape) > 1 else None
            if isinstance(length, int) and given.ndim == 2 and given.shape[1] != length:
                if value.name not in TOKEN_INPUTS:  # (a prompt: never cut)
                    raise GlassloopError(
                        f"predict: the file takes {length} tokens a row, these rows have "
                        f"{given.shape[1]}"
                    )
                # A text's token ids padded (or cut) to the file's fixed length, as exported.
                given = fixed_length(given, length, value.name, self.spec)
            feed[value.name] = given
        return np.asarray(self.session.run(None, feed)[0])


def fixed_length(values: np.ndarray, length: int, name: str, spec: dict[str, Any]) -> np.ndarray:
    """A text model's ``input_ids`` (padded with its ``pad_id``) or ``attention_mask``
    (with 0), ``[batch, tokens]``, padded or cut to ``length`` tokens."""
    fill = int(spec.get("pad_id", 0)) if name == "input_ids" else 0
    padded = np.full((len(values), length), fill, dtype=values.dtype)
    padded[:, : min(length, values.shape[1])] = values[:, :length]
    return padded


MAX_INPUT_VALUES = 1 << 26  # an example's values at most (a 4096x4096 RGB image is 50 M)


def checked(description: Any) -> dict[str, Any]:
    """A file's description, each field of the type and range ``Inputs`` reads (a file is
    input: a planted one is refused in one line, never a crash or a huge allocation)."""
    shape = description["input_shape"]
    if not (isinstance(shape, list) and shape and all(isinstance(d, int) and d > 0 for d in shape)):
        raise ValueError(f"input_shape = {shape!r}")
    if int(np.prod(shape, dtype=np.float64)) > MAX_INPUT_VALUES:
        raise ValueError(f"input_shape = {shape!r} holds over {MAX_INPUT_VALUES:,} values")
    kinds = {"preprocessing": dict, "class_names": list, "task": str, "num_classes": int}
    for key, kind in kinds.items():
        if key in description and not isinstance(description[key], kind):
            raise ValueError(f"{key} = {description[key]!r} is no {kind.__name__}")
    numbers = ("scale", "image_to_raw", "mean", "std", "example_means", "max_length")
    for key in numbers:
        value = description.get("preprocessing", {}).get(key)
        if value is not None and not np.issubdtype(np.asarray(value).dtype, np.number):
            raise ValueError(f"preprocessing {key} = {value!r} is not numbers")
    return dict(description)
