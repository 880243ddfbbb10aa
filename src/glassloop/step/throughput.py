"""How fast an epoch trained: samples/s, tokens/s (a language model's) and MFU.

Every epoch row gets ``seconds`` (the whole epoch, validation included) and
``samples_per_s`` (training samples of every process over the training part alone); a
language model's also ``tokens_per_s`` (target positions, padding included, as the Hugging
Face Trainer counts ``input_ids``); on a GPU whose peak is known, under bf16/fp16, ``mfu``:
the model FLOPs the training did per second (counted once, in a fit's first step, by
``torch.utils.flop_counter``: matrix products and convolutions, forward and backward) over
the peak of every process's GPU. A resumed epoch counts from the resume, so its rates are
rates. Nothing here reads the device during an epoch (no host sync per step).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from glassloop.distributed.world import World, all_reduce

# An epoch row's numbers that differ run to run (timings and rates): left out wherever two
# runs' rows are compared (verify-resume, the tests).
TIMING = ("seconds", "samples_per_s", "tokens_per_s", "mfu", "max_memory_mb", "checkpoint_s")

# Peak dense bf16/fp16 tensor FLOP/s by the CUDA device's name (vendors' data sheets; SXM
# parts where there are several). A name not here: no MFU (a wrong peak is worse than none).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak dense FLOP/s at ``precision``, when known (bf16/fp16 on a CUDA GPU
    named in :data:`PEAK_FLOPS`); ``None`` otherwise."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


class Throughput:
    """One fit's speed, an epoch at a time: :meth:`start` with the samples the epoch has
    already seen (a resumed one's), :meth:`add` per step of a language model, :meth:`stop`
    when the training batches end, :meth:`row` with the samples seen by then."""

    def __init__(self, *, tokens: bool, peak: float | None, world: World) -> None:
        self.tokens = tokens  # a language model: count target positions too
        self.peak = peak
        self.world = world
        # FLOPs of one sample (or token): counted in a fit's first step when MFU is known.
        self.flops_per_unit: float | None = None
        self.counting = peak is not None
        self.started = self.stopped = time.perf_counter()
        self.before = 0  # this process's samples of the epoch before start()
        self.tokens_seen = 0  # this process's tokens since start()

    def start(self, samples: int) -> None:
        self.started, self.before, self.tokens_seen = time.perf_counter(), samples, 0

    def add(self, micro: list[tuple[Any, Any]]) -> None:
        """A language model's step: its targets' positions."""
        self.tokens_seen += positions(micro)

    def count(self, step: Callable[[Any], Any], window: Any, micro: list[tuple[Any, Any]]) -> Any:
        """``step(window)`` (a fit's first) under the FLOP counter; its FLOPs per sample (or
        token) are what MFU multiplies by."""
        self.counting = False
        with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
            # (the counter's module hooks make a compiled model warn that they fire twice:
            # they count nothing twice, FLOPs are counted per operation)
            warnings.filterwarnings("ignore", "Using `torch.compile", UserWarning)
            result = step(window)
        units = positions(micro) if self.tokens else window.local  # (this process's)
        if units:
            self.flops_per_unit = counter.get_total_flops() / units
        return result

    def stop(self) -> None:
        self.stopped = time.perf_counter()

    def row(self, samples: int, device: torch.device | None = None) -> dict[str, Any]:
        """``samples_per_s`` (and ``tokens_per_s``, ``mfu``) over every process, for the
        epoch's row (a collective with several processes); ``samples``: this process's
        samples of the epoch by now. On a GPU also ``max_memory_mb``, the peak memory this
        process allocated."""
        memory: dict[str, Any] = {}
        if device is not None and device.type == "cuda":
            memory["max_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        counts = torch.tensor([samples - self.before, self.tokens_seen], dtype=torch.float64)
        if self.world.distributed:
            counts = all_reduce(counts)
        seconds = self.stopped - self.started
        if seconds <= 0:
            return {**memory, "samples_per_s": None}
        seen, tokens = float(counts[0]), float(counts[1])
        row: dict[str, Any] = {**memory, "samples_per_s": seen / seconds}
        if self.tokens:
            row["tokens_per_s"] = tokens / seconds
        if self.flops_per_unit is not None and self.peak:
            units = tokens if self.tokens else seen
            row["mfu"] = self.flops_per_unit * units / seconds / (self.peak * self.world.size)
        return row


def positions(micro: list[tuple[Any, Any]]) -> int:
    """The target positions of a window's micro-batches (a language model's tokens)."""
    return sum(t.numel() for _, t in micro if isinstance(t, torch.Tensor))
