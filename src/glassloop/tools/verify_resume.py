"""Exact resume, proved on the user's own machine (``glassloop verify-resume``).

A run is trained twice from the same config: once straight through, once killed with
``SIGKILL`` right after step K (before anything else of that step is saved, like a power
cut) and resumed in a new process. Exact resume means the two end in the same place, and
:func:`fingerprints` says so in SHA-256 digests of what must match: the final weights, the
optimizer's state, the other stateful parts (loop position, scheduler, scaler, EMA, data
order), every process's RNG, and every reported number of every epoch (wall-clock times
aside). Each run is a child process that dies with this one: a SIGTERM/SIGINT is passed on
to it, it is waited for and the temporary folder removed (:class:`TrainingRuns`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from glassloop.callbacks import AnyTrainer, Callback
from glassloop.distributed.preemption import die_with_parent
from glassloop.errors import CheckpointError
from glassloop.run_dir import layout
from glassloop.run_dir.checkpoints import latest_pointer, read_checkpoint
from glassloop.step.throughput import TIMING
from glassloop.storage.serialization import flatten
from glassloop.storage.weights import read_safetensors

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
    if latest is None or not (run_dir / layout.WEIGHTS).is_file():
        raise CheckpointError(f"verify-resume: '{run_dir}' holds no finished run")
    checkpoint = read_checkpoint(latest)
    state = checkpoint.state
    weights, _ = read_safetensors(run_dir / layout.WEIGHTS)
    parts = ("loop", "scheduler", "scaler", "ema", "data", "callbacks")
    history = [{k: v for k, v in row.items() if k not in TIMING} for row in state["history"]]
    return {
        "weights": digest(weights),
        "optimizer": digest(state["optimizer"]),
        "other state": digest({part: state.get(part) for part in parts}),
        "rng": digest({"rng": state["rng"], "per_rank": state.get("rng_per_rank")}),
        "numbers": digest(history),
    }


class Interrupted(Exception):
    """verify-resume got SIGTERM/SIGINT: its training run was stopped and waited for."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(
            f"verify-resume: stopped by {signal.Signals(signum).name}; nothing verified"
        )


class TrainingRuns:
    """verify-resume's training runs, one child process at a time: each dies with this
    process (Linux: its parent-death signal, so a ``kill -9`` of this one leaves no orphan
    training), and a SIGTERM/SIGINT that reaches this process is passed on to the running
    child, which is waited for; then :class:`Interrupted` is raised (a ``with`` around it
    removes the temporary folder as it unwinds). The handlers are ours for the whole
    ``with``: a signal between two runs starts no further one."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[str] | None = None
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> TrainingRuns:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # (a training run checkpoints and stops)

    def run(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        """``command`` to its end, its output captured (as ``subprocess.run``)."""
        if self.received is None:
            pipe, dies = subprocess.PIPE, die_with_parent
            self.child = subprocess.Popen(
                command, stdout=pipe, stderr=pipe, text=True, errors="replace", preexec_fn=dies
            )
            if self.received is not None:  # (one that came while it started)
                self.child.send_signal(self.received)
            out, err = self.child.communicate()  # (a signal meanwhile: forwarded, waited for)
            code, self.child = self.child.returncode, None
        if self.received is not None:
            raise Interrupted(self.received)
        return subprocess.CompletedProcess(command, code, out, err)
