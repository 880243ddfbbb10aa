"""What a checkpoint holds, taken from the live run at one moment: the weights and the state's
tensors as CPU tensors, everything else as JSON text. A background save takes private copies
(:class:`HostCopy`), since training goes on changing the originals while the copy is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from glassloop.errors import CheckpointError
from glassloop.storage.serialization import UnserializableError, finite_json, flatten, stable_repr
from glassloop.storage.weights import weights_dict, weights_metadata


@dataclass
class Snapshot:
    """A checkpoint's contents taken from the run at one moment: the weights and the state's
    tensors as CPU tensors (private copies when the write goes on in the background while
    training changes the originals), everything else already JSON text."""

    step: int
    weights: dict[str, torch.Tensor] | None  # None: a sharded checkpoint's, already staged
    weights_metadata: dict[str, str]
    tensors: dict[str, torch.Tensor]
    tree: bytes  # state.json
    meta: bytes  # meta.json

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors (what a checkpoint's GB/s counts)."""
        tensors = [*self.tensors.values(), *(self.weights or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(
    model: nn.Module | dict[str, torch.Tensor] | None,
    state: dict[str, Any],
    meta: dict[str, Any],
    to_host: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Snapshot:
    """What a checkpoint holds of ``model`` (``None``: a sharded run's weights, staged by its
    processes), ``state`` and ``meta``, taken now (``to_host``: how a
    tensor reaches the CPU, e.g. a copy that training cannot change). Raises
    :class:`CheckpointError` for a state that cannot be stored without pickle."""
    try:
        tree, tensors = flatten(state, to_host)
    except UnserializableError as err:
        raise CheckpointError(f"checkpoint: {err}") from err
    text = json.dumps(finite_json(meta), indent=1, default=stable_repr, allow_nan=False) + "\n"
    return Snapshot(
        step=int(meta["step"]),
        weights=weights_dict(model, to_host) if model is not None else None,
        weights_metadata=weights_metadata(meta.get("model_spec")),
        tensors=tensors,
        tree=json.dumps(tree, allow_nan=False).encode("utf-8"),
        meta=text.encode("utf-8"),
    )


class HostCopy:
    """Private CPU copies of a state's tensors, in buffers kept from one save to the next:
    pinned on CUDA (the device-to-host copies then run asynchronously, all waited for once in
    :meth:`finish`), reused everywhere (a fresh 0.5 GB buffer costs its page faults every
    save). Safe to reuse because one save at a time is in flight."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.used = 0
        self.devices: set[torch.device] = set()  # the CUDA devices copied from
        self.later: set[int] = set()
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, original)

    def begin(self, later: set[int] | None = None) -> None:
        """Start a copy; the tensors whose memory starts at an address in ``later`` (the
        parameters and the optimizer's state: nothing changes them before the next
        optimizer step) are copied by :meth:`copy_later`, not now."""
        self.used, self.devices, self.later, self.pending = 0, set(), later or set(), []

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        index, self.used = self.used, self.used + 1
        buffer = self.buffers[index] if index < len(self.buffers) else None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.is_cuda
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self.buffers[index : index + 1] = [buffer]
        if tensor.numel() and tensor.data_ptr() in self.later:
            self.pending.append((buffer, tensor))
        else:
            self._copy(buffer, tensor)
        return buffer

    def _copy(self, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            self.devices.add(tensor.device)

    def copy_later(self) -> None:
        """Make the copies :meth:`begin` left for later (a background save's writer, while
        the next step's forward and backward run; its optimizer step waits for them)."""
        pending, self.pending = self.pending, []
        for buffer, tensor in pending:
            self._copy(buffer, tensor)
        self.finish()

    def finish(self) -> None:
        """Wait for the device-to-host copies (pinned, asynchronous) to land."""
        for device in self.devices:  # (each: synchronize() alone waits for the current one)
            torch.cuda.synchronize(device)
