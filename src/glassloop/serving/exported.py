"""A model as a file that runs outside Python's training stack, checked against the model at
export: an ONNX file (:func:`export_onnx`, run by onnxruntime) or a ``torch.export`` program
(:func:`export_program`, ``torch.export.load(path).module()``).

Both start from one ``torch.export.export`` of the model in eval mode (non-strict), with the
batch axis dynamic (a text model's length is the example's: pad to it); the ONNX file is
made from that program (``torch.onnx.export(..., dynamo=True)``), so a model whose ``forward``
branches on a tensor's value is refused in one line naming the line of ``forward`` where the
export stopped, never exported for the one branch its example took. The file computes what
:func:`glassloop.predict` returns (class probabilities, label probabilities or values): the
task's activation is inside it. It is written to a temporary name, run on the given inputs
and on batches of 1 and 7, compared with the model; above ``atol`` it is refused (the file
not left behind), else renamed into place.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.errors import GlassloopError, ModelError
from glassloop.evaluation.evaluate import activated
from glassloop.serving.onnx_predictor import METADATA, require_onnxruntime
from glassloop.storage.atomic import atomic_path
from glassloop.tasks import outputs_are_probabilities

ATOL = 1e-4  # the largest absolute difference an fp32 export may have from the model
EXTRA_FILE = "glassloop.model.json"  # the same in a torch.export program's archive
BATCHES = (1, 7)  # batch sizes each export is checked on, besides the given inputs'


@dataclass(frozen=True)
class Exported:
    """What an export wrote and how close it came to the model."""

    path: Path
    largest_difference: float  # over every output of every checked batch
    batch_sizes: tuple[int, ...]  # the batches checked
    opset: int | None = None  # an ONNX file's (default domain)


class Served(nn.Module):
    """The model and its task's activation: what :func:`glassloop.predict` computes, for the
    inputs named ``keys`` in order (``["input"]``: the model's one positional input; else
    passed by name, as a text model takes ``input_ids``...)."""

    def __init__(self, model: nn.Module, task: str, classes: int | None, keys: list[str]) -> None:
        super().__init__()
        self.model, self.task, self.classes, self.keys = model, task, classes, keys
        # A model ending in a sigmoid or softmax: its outputs as they are (as predict decides).
        self.probabilities = outputs_are_probabilities("auto", model, None)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.keys, args, strict=True))
        output = self.model(*args) if self.keys == ["input"] else self.model(**named)
        return activated(
            output, task=self.task, classes=self.classes, probabilities=self.probabilities
        )


def export_program(
    model: nn.Module,
    path: str | Path,
    example: Any,
    *,
    task: str = "classification",
    description: dict[str, Any] | None = None,
    atol: float = ATOL,
) -> Exported:
    """Write ``model`` (with ``task``'s activation) as a ``torch.export`` program to
    ``path`` (``torch.export.save``; ``description`` in its archive as
    ``glassloop.model.json``), checked on ``example`` (a batch of inputs, or a text
    model's ``{"input_ids": ..., ...}``) and on batches of 1 and 7.

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "model.pt2"
    >>> done = export_program(nn.Linear(4, 3), path, torch.randn(5, 4))
    >>> done.largest_difference < 1e-6, torch.export.load(path).module()(torch.randn(2, 4)).shape
    (True, torch.Size([2, 3]))
    """
    served, program, batches = _traced(model, example, task, description)
    extra = {EXTRA_FILE: json.dumps(description or {}, sort_keys=True)}
    archive = io.BytesIO()  # (torch.export.save takes a buffer or a name ending in .pt2)
    torch.export.save(program, archive, extra_files=extra)
    archive.seek(0)
    loaded = torch.export.load(archive).module()
    with atomic_path(Path(path)) as tmp:
        tmp.write_bytes(archive.getvalue())
        difference = _compare(served, batches, lambda inputs: _call(loaded, inputs), atol, path)
    return Exported(Path(path), difference, tuple(_size(b) for b in batches))


def export_onnx(
    model: nn.Module,
    path: str | Path,
    example: Any,
    *,
    task: str = "classification",
    description: dict[str, Any] | None = None,
    atol: float = ATOL,
) -> Exported:
    """Write ``model`` (with ``task``'s activation) as an ONNX file to ``path``: inputs named
    ``input`` (or a text model's ``input_ids``, ...), output ``output``, a dynamic batch axis,
    ``description`` in its metadata (``glassloop.model``); checked with onnxruntime on
    ``example`` and on batches of 1 and 7. Needs ``pip install 'glassloop[export]'``."""
    onnxruntime = require_onnxruntime()
    served, program, batches = _traced(model, example, task, description)
    with quiet():
        onnx_program = torch.onnx.export(program, dynamo=True, verbose=False)
    assert onnx_program is not None
    graph = onnx_program.model.graph
    for value, key in zip(graph.inputs, served.keys, strict=True):
        value.name = key  # (torch.export calls them args_0, args_1, ...)
    graph.outputs[0].name = "output"
    names = [value.name for value in graph.inputs]
    onnx_program.model.metadata_props[METADATA] = json.dumps(description or {}, sort_keys=True)
    opset = onnx_program.model.opset_imports.get("")
    with atomic_path(Path(path)) as tmp:
        onnx_program.save(str(tmp), external_data=False)  # (one file: 2 GB at most)
        session = onnxruntime.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])

        def run(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            feed = {str(name): inputs[str(name)].numpy() for name in names}  # (those it uses)
            return torch.from_numpy(session.run(None, feed)[0])

        difference = _compare(served, batches, run, atol, path)
    return Exported(Path(path), difference, tuple(_size(b) for b in batches), opset)


def _traced(
    model: nn.Module, example: Any, task: str, description: dict[str, Any] | None
) -> tuple[Served, torch.export.ExportedProgram, list[dict[str, torch.Tensor]]]:
    """The served model, its program (``torch.export``, non-strict, dynamic batch) and the
    batches to check it on: ``example`` and batches of 1 and 7 rows cut from it (repeated)."""
    inputs = inputs_of(example)
    if _size(inputs) < 2:  # (a batch of one would fix the batch axis at 1)
        inputs = {key: value[torch.arange(2) % len(value)] for key, value in inputs.items()}
    classes = (description or {}).get("num_classes", getattr(model, "num_classes", None))
    keys = list(inputs)
    served = Served(model.eval(), task, classes if isinstance(classes, int) else None, keys)
    # The batch axis only: a GRU's trace fixes the length of its sequence (a text model's
    # token ids are padded to that length; a unidirectional GRU never sees the padding).
    batch = torch.export.Dim("batch", min=1)
    try:
        with quiet(), torch.no_grad():
            program = torch.export.export(
                served,
                tuple(inputs.values()),
                dynamic_shapes={"args": tuple({0: batch} for _ in keys)},
                strict=False,
            )
    except Exception as err:  # torch.export's many refusals: one line, where it stopped
        raise ModelError(f"export: torch.export could not trace the model: {_where(err)}") from None
    rows = _size(inputs)
    batches = [inputs] + [
        {key: value[torch.arange(n) % rows] for key, value in inputs.items()} for n in BATCHES
    ]
    return served, program, batches


def _compare(
    served: Served,
    batches: list[dict[str, torch.Tensor]],
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    atol: float,
    path: str | Path,
) -> float:
    """The largest absolute difference between the exported file's outputs and the model's
    on every batch; above ``atol`` a :class:`GlassloopError` (the caller's temporary file is
    removed: nothing is left at ``path``)."""
    largest = 0.0
    with torch.no_grad():
        for inputs in batches:
            expected, got = _call(served, inputs).float(), run(inputs).float()
            if got.shape != expected.shape:
                raise GlassloopError(
                    f"export: the exported file gives shape {tuple(got.shape)} for a batch of "
                    f"{_size(inputs)}, the model {tuple(expected.shape)}; nothing was written"
                )
            largest = max(largest, float((got - expected).abs().max()) if got.numel() else 0.0)
    if not largest <= atol:  # (NaN too)
        raise GlassloopError(
            f"export: the exported file differs from the model by up to {largest:.3g} "
            f"(above --atol {atol:g}); '{path}' was not written"
        )
    return largest


def inputs_of(example: Any) -> dict[str, torch.Tensor]:
    """A batch by name: ``{"input": x}``, or a text model's ``input_ids``, ... as given
    (tensors or numpy arrays)."""
    if isinstance(example, Mapping):
        return {str(key): torch.as_tensor(value) for key, value in example.items()}
    return {"input": torch.as_tensor(example)}


def _call(module: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The served model, or its export, on a batch: its inputs in order."""
    return module(*inputs.values())


def _size(inputs: Mapping[str, torch.Tensor]) -> int:
    return int(next(iter(inputs.values())).shape[0])


def _where(err: BaseException) -> str:
    """Where in the user's code an export stopped (``file:line: code``, the innermost
    frame outside torch and glassloop) and the first line of torch's reason."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    calls = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s+(.+)', str(err))
    frames = [
        (f.filename, str(f.lineno), f.line or "")
        for f in traceback.extract_tb(err.__traceback__)
        if "/torch/" not in f.filename and "/glassloop/" not in f.filename
    ]
    found = calls or frames
    if not found:
        return reason
    file, line, code = found[-1]
    return f"{file}:{line}: {code.strip()} ({reason})"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The exporters' log records (torch's graphs and fallbacks, onnxruntime's advice) and
    torch's own deprecation warnings held back: the export says what matters in its own
    lines, and a refusal is one."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:  # (a failed trace also prints its graph to stderr itself)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", "The tensor attributes")  # (a GRU's, traced)
            yield
    finally:
        logging.disable(previous)
