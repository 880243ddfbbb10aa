"""``glassloop export RUN --format onnx|torch-export``: a run's model rebuilt from its files
(:func:`glassloop.tools.run_evaluation.rebuilt`, as ``glassloop eval`` rebuilds it), exported
(:mod:`glassloop.serving.exported`) and checked on a batch of the run's own validation inputs
and on batches of 1 and 7; ``--quantize int8`` (onnxruntime's dynamic quantization) with the
validation accuracy before and after."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassloop.batch import split_batch
from glassloop.data.loaders import LoaderPosition
from glassloop.errors import GlassloopError
from glassloop.serving.exported import ATOL, Exported, export_onnx, export_program, quiet
from glassloop.storage.atomic import atomic_path
from glassloop.tools.run_evaluation import rebuilt

FORMATS = ("onnx", "torch-export")


def export_run(
    source: str | Path,
    output: str | Path,
    fmt: str,
    *,
    atol: float = ATOL,
    quantize: str | None = None,
    trust_code: bool = False,
    say: Callable[[str], None] = print,
) -> Exported:
    """Export the run ``source`` (a run directory, a checkpoint) to ``output`` as ``fmt``;
    what it did, in lines to ``say``."""
    if quantize not in (None, "int8") or (quantize and fmt != "onnx"):
        raise GlassloopError("export: --quantize int8 is for --format onnx only")
    parts, weights = rebuilt(source, trust_code=trust_code, who="export")
    model = parts.model.cpu().eval()
    batch = next(iter(parts.val_loader))
    if isinstance(parts.val_loader, LoaderPosition):  # (the peek undone: scores read it all)
        parts.val_loader.load_state_dict({"epoch": 0, "batches_consumed": 0})
    (args, kwargs), _ = split_batch(batch)
    example: Any = args[0].cpu() if args and not kwargs else {k: v.cpu() for k, v in kwargs.items()}
    description = json.loads(weights.metadata.get("glassloop.model", "{}"))
    if isinstance(example, dict) and "input_ids" in example:  # (the file's fixed length)
        length = int(description.get("preprocessing", {}).get("max_length", 256))
        pad = {"input_ids": int(description.get("pad_id", 0)), "attention_mask": 0}
        example = {k: _pad(v, length, pad[k]) if k in pad else v for k, v in example.items()}
    export = export_onnx if fmt == "onnx" else export_program
    done = export(model, output, example, task=parts.task, description=description, atol=atol)
    sizes = ", ".join(map(str, done.batch_sizes))
    opset = f", opset {done.opset}" if done.opset is not None else ""
    say(
        f"exported {done.path} ({fmt}{opset}, {Path(done.path).stat().st_size:,} bytes): "
        f"largest difference to the model {done.largest_difference:.3g} on batches of {sizes} "
        f"(--atol {atol:g})"
    )
    if "tokenizer" in description.get("preprocessing", {}):
        say(
            "the tokenizer is in the file's metadata (glassloop.model), not in its graph: the "
            "graph takes token ids padded to its fixed length (input_ids, attention_mask, "
            "lengths); glassloop predict tokenizes and pads text lines with it"
        )
    if quantize:
        name, before, after = quantize_int8(Path(done.path), parts.val_loader, parts.task)
        size = Path(done.path).stat().st_size
        say(f"quantized to int8 ({size:,} bytes): validation {name} {before} before, {after} after")
    return done


def _pad(value: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """``value`` ([batch, tokens]) padded with ``fill`` (or cut) to ``length`` tokens."""
    padded = torch.full((value.shape[0], length), fill, dtype=value.dtype)
    padded[:, : min(length, value.shape[1])] = value[:, :length]
    return padded


def quantize_int8(path: Path, loader: Any, task: str) -> tuple[str, str, str]:
    """Replace the ONNX file at ``path`` with onnxruntime's dynamic int8 quantization of it;
    the validation accuracy (another task: the mean absolute output) before and after."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from glassloop.serving.onnx_predictor import OnnxPredictor

    scores = []
    with atomic_path(path) as tmp, quiet():
        quantize_dynamic(path, tmp, weight_type=QuantType.QInt8)
        for file in (path, tmp):
            scores.append(_score(OnnxPredictor(file), loader, task))
    name = "accuracy" if task == "classification" else "mean absolute output"
    return name, scores[0], scores[1]


def _score(predictor: Any, loader: Any, task: str) -> str:
    """Accuracy on ``loader`` (a classifier), else the mean absolute output."""
    right = total = 0
    outputs = []
    for batch in loader:
        (args, kwargs), target = split_batch(batch)
        inputs = {"input": args[0]} if args and not kwargs else kwargs
        out = predictor.outputs({k: v.cpu().numpy() for k, v in inputs.items()})
        outputs.append(np.abs(out).mean())
        if task == "classification":
            right += int((out.argmax(-1) == torch.as_tensor(target).numpy()).sum())
            total += len(out)
    if task == "classification":
        return f"{100 * right / max(total, 1):.2f}%"
    return f"{float(np.mean(outputs)):.6g}"
