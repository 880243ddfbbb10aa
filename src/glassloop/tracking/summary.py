"""What a run says when it starts (device, model size, data, batch, optimizer, schedule, run
directory) and when it ends (time, best epoch, where the weights and the report are).

    glassloop: cpu (2 threads), precision 32, 1 process
    model: Sequential, 669,706 parameters (669,706 trainable)
    data: 4,000 training samples, 1,000 validation; 63 steps per epoch, 10 epochs
    batch: 64 = 64 per step x 1 accumulation x 1 process
    optimizer: AdamW (lr 0.001, weight_decay 0.01); schedule: CosineAnnealingLR per epoch
    run directory: runs/demo
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from glassloop.best import best_epoch, shown
from glassloop.distributed.fsdp import class_name
from glassloop.distributed.world import World, unwrap_model
from glassloop.options import CheckpointConfig
from glassloop.run_dir import layout
from glassloop.state import SaveTimes, TrainState
from glassloop.tracking.launched import since_launch


class HasPolicy(Protocol):
    """What the end summary reads of a checkpointer: its policy (what picks the best) and
    how long its saves took."""

    @property
    def policy(self) -> CheckpointConfig: ...
    @property
    def times(self) -> SaveTimes: ...


class Shown(Protocol):
    """What the header and the summary call the run directory (a remote run's URL)."""

    shown: str


class Described(Protocol):
    """What the start header and the end summary read of a trainer."""

    device: torch.device
    world: World
    sharded: Any
    model: nn.Module
    precision: str
    task: str
    limit_batches: int
    grad_accum_steps: int
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scheduler_interval: str
    loss_fn: Any
    loss_reduction: str
    run_dir: Path | None
    state: TrainState
    stop_signals: Sequence[str]
    grace_s: float

    @property
    def checkpointer(self) -> HasPolicy: ...

    @property
    def run(self) -> Shown: ...

    @property
    def history(self) -> list[dict[str, Any]]: ...


def samples_in(loader: Iterable[Any]) -> int | None:
    """How many samples ``loader`` yields per epoch, when it can tell (``None`` otherwise)."""
    dataset: Any = getattr(loader, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


def start_header(
    trainer: Described, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int
) -> str:
    device = trainer.device
    where = f"{device} ({counted(torch.get_num_threads(), 'thread')})"
    where = where if device.type == "cpu" else str(device)
    processes = f"{trainer.world.size} process{'es' if trainer.world.size > 1 else ''}"
    if trainer.world.size > 1:
        processes += " (FSDP)" if trainer.sharded is not None else " (DDP)"
    model = unwrap_model(trainer.model)
    lines = [
        f"glassloop: {where}, precision {trainer.precision}, {processes}, task {trainer.task}",
        f"model: {class_name(model)}, {counts(model)}",
    ]
    if (parts := model_parts(model)) is not None:
        lines.append(parts)
    train_n, val_n = samples_in(train_loader), (samples_in(val_loader) if val_loader else None)
    data = [f"{train_n:,} training samples" if train_n is not None else "training data"]
    if val_loader is not None:
        data.append(f"{val_n:,} validation" if val_n is not None else "validation data")
    try:
        batches = len(train_loader)  # type: ignore[arg-type]
        batches = min(batches, trainer.limit_batches or batches)
        count = math.ceil(batches / trainer.grad_accum_steps)
        steps = f"; {count} step{'s' if count != 1 else ''} per epoch"
    except TypeError:
        steps = ""
    lines.append(f"data: {', '.join(data)}{steps}, {counted(epochs, 'epoch')}")
    batch = getattr(train_loader, "batch_size", None)
    if isinstance(batch, int):
        accum, size = trainer.grad_accum_steps, trainer.world.size
        line = (
            f"batch: {batch * accum * size} = {batch} per step x {accum} accumulation x "
            f"{size} process{'es' if size > 1 else ''}"
        )
        if size > 1:  # (a batch size is each process's: N processes take N times the samples)
            line += (
                f"; the batch size is each process's, so {size} processes take {size}x one "
                f"process's samples per step (batch size {batch // size or 1} keeps "
                f"{(batch // size or 1) * size}); step lines count this process's samples"
            )
        lines.append(line)
    optimizer = trainer.optimizer
    optimizers = optimizer if isinstance(optimizer, dict) else {"": optimizer}
    described = [f"{n + ': ' if n else ''}{described_optimizer(o)}" for n, o in optimizers.items()]
    schedule = "none"
    if trainer.scheduler is not None:
        kind = type(trainer.scheduler).__name__
        # a config's name for it first ("warmup_cosine" is a LambdaLR: the class says little)
        named = ((getattr(trainer, "config", None) or {}).get("scheduler") or {}).get("name")
        if isinstance(named, str) and named and named.lower() != kind.lower():
            kind = f"{named} ({kind})"
        schedule = f"{kind} per {trainer.scheduler_interval}"
    lines.append(f"optimizer: {'; '.join(described)}; schedule: {schedule}")
    if (note := loss_note(trainer.loss_fn, trainer.loss_reduction)) is not None:
        lines.append(note)
    if trainer.run_dir is not None:
        here, shown = str(trainer.run_dir), trainer.run.shown
        lines.append(f"run directory: {shown}{f' (local copy: {here})' if shown != here else ''}")
        if trainer.grace_s:  # (the first save's time is said against it when known)
            signals = ", ".join(f"SIG{name}" for name in trainer.stop_signals)
            lines.append(
                f"preemption: {signals} stop with a checkpoint; grace {trainer.grace_s:g} s "
                "(checked against the first save)"
            )
    return "\n".join(lines)


def described_optimizer(optimizer: Any) -> str:
    """``AdamW (lr 0.001, weight_decay 0.01)``."""
    settings = ", ".join(
        f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in optimizer.defaults.items()
        if k in ("lr", "weight_decay", "momentum")
    )
    return f"{type(optimizer).__name__} ({settings})"


def loss_note(loss_fn: Any, reduction: str) -> str | None:
    """One line saying what ``train_loss`` and ``val_loss`` are, when the loss does not say
    it itself (a sum over the batch, or a function with no ``reduction``)."""
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    if reduction == "sum":
        return f"loss: {name} sums over each batch; train_loss and val_loss are per sample"
    if loss_fn is None or hasattr(loss_fn, "reduction") or isinstance(loss_fn, torch.nn.Module):
        return None
    if getattr(loss_fn, "__module__", None) == "torch.nn.functional":
        return None  # torch's own (F.nll_loss, F.cross_entropy, ...): a mean unless told
    return (
        f"loss: {name} is taken as a mean over each batch (losses are reported per sample "
        "as such); if it sums over the batch, pass loss_reduction='sum'"
    )


def counts(module: nn.Module) -> str:
    """``"669,706 parameters (669,706 trainable)"``; frozen ones named when there are."""
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = f", {total - trainable:,} frozen" if trainable < total else ""
    return f"{total:,} parameters ({trainable:,} trainable{frozen})"


def model_parts(model: nn.Module, shown: int = 8) -> str | None:
    """The header's second model line: each top-level part with parameters (through wrappers
    of one part: a peft model's base, a ``Sequential`` in a module), its class and count,
    and whether it trains (Lightning's model summary, on one line); ``None`` for a model of
    fewer than two such parts.

    >>> from torch import nn
    >>> last = nn.Linear(4, 1).requires_grad_(False)
    >>> model_parts(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), last))
    'parts: 0 Linear 12 · 2 Linear 5 (frozen)'
    """
    module, prefix = model, ""
    for _ in range(4):  # (down through a part that is alone)
        found = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(found) != 1:
            break
        prefix, module = f"{prefix}{found[0][0]}.", found[0][1]
    if len(found) < 2:
        return None
    described = []
    for name, part in found[:shown]:
        total = sum(p.numel() for p in part.parameters())
        trainable = sum(p.numel() for p in part.parameters() if p.requires_grad)
        note = " (frozen)" if not trainable else f" ({trainable:,} trainable)"
        note = "" if trainable == total else note
        described.append(f"{prefix}{name} {class_name(part)} {total:,}{note}")
    more = f" · {len(found) - shown} more" if len(found) > shown else ""
    return "parts: " + " · ".join(described) + more


def end_summary(trainer: Described, report: Path | None) -> str:
    history = trainer.history
    state = trainer.state
    # one definition of the run's time (run.json, glassloop runs and the report say the same)
    wall = state.wall_s if state.wall_s is not None else since_launch()
    # (rounded as run.json rounds them first: the two never differ in the last digit)
    train_s, wall = round(state.train_seconds(), 2), round(wall, 2)
    trained = f"{train_s:.1f} s of training ({wall:.1f} s since launch)"
    if train_s > wall:  # (a resumed run's training time counts its earlier commands too)
        trained = f"{train_s:.1f} s of training in all ({wall:.1f} s since this launch)"
    parts = [f"done in {trained}: {counted(state.epoch, 'epoch')}, {counted(state.step, 'step')}"]
    policy = trainer.checkpointer.policy
    best = best_epoch(history, policy.monitor, policy.mode)
    if best is not None:
        name, value, epoch = best
        parts.append(f"best {name} {shown(name, value)} (epoch {epoch})")
    last = history[-1] if history else {}
    if "val_accuracy" in last:
        parts.append(f"final val_accuracy {shown('val_accuracy', last['val_accuracy'])}")
    lines = ["; ".join(parts)]
    saves = trainer.checkpointer.times.summary()
    if saves is not None:  # (rank 0's: the one that writes)
        lines.append(
            f"checkpoints: {saves['saves']} saved, the step held {saves['blocking_s']:.2f} s "
            f"each, written in {saves['total_s']:.2f} s ({speed(saves['gb_per_s'])}; medians)"
        )
    if trainer.run_dir is not None:
        weights = shown_path(trainer.run, trainer.run_dir, trainer.run_dir / layout.WEIGHTS)
        said = f"; report: {shown_path(trainer.run, trainer.run_dir, report)}" if report else ""
        lines.append(f"weights: {weights}{said}")
    return "\n".join(lines)


def shown_path(run: Shown, run_dir: Path, path: Path) -> str:
    """``path`` in the run directory as the run is called: under a remote run's URL (where
    the upload puts it), else the path itself."""
    if run.shown == str(run_dir):
        return str(path)
    return f"{run.shown}/{path.relative_to(run_dir).as_posix()}"


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless one ("1 thread", "2 epochs").

    >>> counted(1, "epoch"), counted(3, "step")
    ('1 epoch', '3 steps')
    """
    return f"{n} {noun}{'' if n == 1 else 's'}"


def speed(gb_per_s: float) -> str:
    """A write speed a small run can show too (its few KB never read ``0.00 GB/s``).

    >>> speed(1.234), speed(0.0421), speed(0.0000153)
    ('1.23 GB/s', '42.1 MB/s', '0.0153 MB/s')
    """
    if gb_per_s >= 0.1:
        return f"{gb_per_s:.2f} GB/s"
    return f"{gb_per_s * 1000:.3g} MB/s"
