"""Exact resume, proved on the user's own machine (``glassloop verify-resume``).

A run is trained twice from the same config: once straight through, once killed with
``SIGKILL`` right after step K (before anything else of that step is saved, like a power
cut) and resumed in a new process. Exact resume means the two end in the same place, and
:func:`fingerprints` says so in SHA-256 digests of what must match: the final weights, the
optimizer's state, the other stateful parts (loop position, scheduler, scaler, EMA, data
order), every process's RNG, and every reported number of every epoch (wall-clock times
aside).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from glassloop.callbacks import AnyTrainer, Callback
from glassloop.checkpoint import latest_pointer, read_checkpoint
from glassloop.errors import CheckpointError
from glassloop.serialization import flatten
from glassloop.throughput import TIMING
from glassloop.weights import read_safetensors

# Keys of an epoch row that measure time, not training.


class KillAfterStep(Callback):
    """``SIGKILL`` this process right after optimizer step ``step`` (its checkpoint, if one
    was due, is not written): what ``glassloop train --kill-at-step`` adds."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: AnyTrainer, step: int, loss: torch.Tensor) -> None:
        if step == self.step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def digest(value: Any) -> str:
    """SHA-256 of a state: its structure and numbers (JSON) and every tensor's dtype, shape
    and bytes, in a fixed order."""
    tree, tensors = flatten(value)
    hasher = hashlib.sha256(json.dumps(tree, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        hasher.update(f"{name} {tensor.dtype} {list(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def fingerprints(run_dir: Path) -> dict[str, str]:
    """The digests of a finished run: ``weights`` (RUN_DIR/model.safetensors), and from its
    last checkpoint ``optimizer``, ``other state``, ``rng`` and ``numbers`` (the history)."""
    latest = latest_pointer(run_dir)
    if latest is None or not (run_dir / "model.safetensors").is_file():
        raise CheckpointError(f"verify-resume: '{run_dir}' holds no finished run")
    checkpoint = read_checkpoint(latest)
    state = checkpoint.state
    weights, _ = read_safetensors(run_dir / "model.safetensors")
    parts = ("loop", "scheduler", "scaler", "ema", "data", "callbacks")
    history = [{k: v for k, v in row.items() if k not in TIMING} for row in state["history"]]
    return {
        "weights": digest(weights),
        "optimizer": digest(state["optimizer"]),
        "other state": digest({part: state.get(part) for part in parts}),
        "rng": digest({"rng": state["rng"], "per_rank": state.get("rng_per_rank")}),
        "numbers": digest(history),
    }
