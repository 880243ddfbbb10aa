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
from glassloop.serving.onnx_predictor import TOKEN_INPUTS, OnnxPredictor, fixed_length
from glassloop.storage.atomic import atomic_path
from glassloop.tools.run_evaluation import rebuilt


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
    example, _ = batch_inputs(batch)
    description = json.loads(weights.metadata.get("glassloop.model", "{}"))
    length = int(description.get("preprocessing", {}).get("max_length", 256))
    for key in set(TOKEN_INPUTS) & set(example):  # (a text's: the file's fixed length)
        example[key] = fixed_length(example[key], length, key, description)
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


def batch_inputs(batch: Any) -> tuple[dict[str, np.ndarray], Any]:
    """A loader's batch as the exported file takes it (``{"input": x}``, or a text model's
    ``input_ids``, ``attention_mask``, ``lengths``), and its target."""
    (args, kwargs), target = split_batch(batch)
    inputs = {"input": args[0]} if args and not kwargs else kwargs
    return {key: value.cpu().numpy() for key, value in inputs.items()}, target


def quantize_int8(path: Path, loader: Any, task: str) -> tuple[str, str, str]:
    """Replace the ONNX file at ``path`` with onnxruntime's dynamic int8 quantization of it;
    the validation accuracy (another task: the mean absolute output) before and after."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

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
        inputs, target = batch_inputs(batch)
        out = predictor.outputs(inputs)
        outputs.append(np.abs(out).mean())
        if task == "classification":
            right += int((out.argmax(-1) == torch.as_tensor(target).numpy()).sum())
            total += len(out)
    if task == "classification":
        return f"{100 * right / max(total, 1):.2f}%"
    return f"{float(np.mean(outputs)):.6g}"
