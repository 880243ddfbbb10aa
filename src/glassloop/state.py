"""The loop's own state: :class:`TrainState` (where the loop is: step, epoch, batch within the
epoch, samples seen, best), :class:`EpochRecord` (what it has recorded so far) and
:class:`SaveTimes` (what its checkpoints cost it; the run directory's, ``RunDir.times``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from glassloop.distributed.world import World, all_reduce
from glassloop.errors import GlassloopError


@dataclass
class TrainState:
    """The loop's position, saved in every checkpoint so a resume knows where it stands.

    ``step`` counts optimizer steps; ``epoch`` counts finished epochs; ``batch_in_epoch``
    counts batches consumed in the current epoch; ``samples_seen`` counts training samples.

    >>> s = TrainState(step=3)
    >>> TrainState().load_state_dict(s.state_dict()) or None
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = 0
    best_metric: float | None = None
    skipped_steps: int = 0  # fp16 overflows and non-finite steps skipped
    consecutive_nonfinite: int = 0
    stopped: bool = False  # stopped early (a callback): the run is finished, whatever epochs says
    # A validation a stop signal cut short, run first on resume: "step" (mid-epoch, at this
    # step) or "epoch" (the epoch's end: its training is done, its row not yet written).
    validation_due: str = ""
    # The last step's gradient norm (clipping), as the loop holds it: a tensor on the device
    # (no host read per step), a float in a checkpoint, so an epoch row written after a
    # resume that took no step of the epoch (an owed validation) still reports it.
    grad_norm: torch.Tensor | float | None = None
    # The run's training time: seconds from each command's header to its end, counted up to
    # the checkpoint a resume goes on from (never the pause before the resume), and when this
    # process's training began (its header): :meth:`train_seconds`. Not in state_dict (a
    # time would make two exact runs' states differ): a checkpoint's meta.json keeps it.
    train_s: float = 0.0
    began: float | None = None
    wall_s: float | None = None  # (not saved) this command's seconds from launch to its end

    def end_clock(self, since_launch: float) -> None:
        """Training ended: its time stops here, and so does this command's since its launch
        (what every place that reports them reads, whenever it reads them)."""
        self.train_s, self.began, self.wall_s = self.train_seconds(), None, since_launch

    def train_seconds(self) -> float:
        """The run's training time so far: the seconds before its resume, if any, and this
        process's since its header (what the end summary, run.json, ``glassloop runs`` and
        the report call training time)."""
        now = time.perf_counter() - self.began if self.began is not None else 0.0
        return self.train_s + now

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["grad_norm"] = None if self.grad_norm is None else float(self.grad_norm)
        del state["train_s"], state["began"], state["wall_s"]  # (times: meta.json's)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
        self.stopped = bool(state.get("stopped", False))
        self.validation_due = str(state.get("validation_due", ""))
        norm = state.get("grad_norm")
        self.grad_norm = None if norm is None else float(norm)
        best = state.get("best_metric")
        self.best_metric = None if best is None else float(best)


class EpochRecord:
    """What the loop records as it goes, beyond its position: the current epoch's per-step
    losses (kept on the device: no host sync per step), each with its weight in the epoch's
    mean (the samples, or tokens, it is the mean over, this process's share of them) and
    this process's sample count, the RNG state a
    plain loader drew this epoch's order from (so a resume can replay it), and the history
    of finished epochs. Its ``state_dict()`` is part of every checkpoint, so a resumed
    epoch's ``train_loss`` is exact."""

    def __init__(self) -> None:
        self.names: list[str] = []  # a train_step's named losses (each step: total, then these)
        self.losses: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.sizes: list[int] = []
        self.steps = 0  # steps recorded this epoch, alike in every process (the step rows')
        # Each loss's step in the epoch where it is not its place in ``losses``: a resume
        # with another number of processes (rank 0 holds every saved process's; None: in order).
        self.positions: list[int] | None = None
        # ``[correct, counted]`` of the epoch's steps (``train_accuracy``; None: not counted)
        self.correct: torch.Tensor | None = None
        self.epoch_rng: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []

    def add_step(
        self,
        loss: torch.Tensor | Mapping[str, torch.Tensor],
        samples: int,
        step_samples: int,
        processes: int,
        *,
        summed: bool = False,
    ) -> torch.Tensor:
        """A step's loss (or named losses), this process's ``samples`` of the step's
        ``step_samples`` over ``processes``; ``summed``: the loss is a sum over the step's
        samples. Kept on the device (no host sync per step), weighted by the step's samples
        per process. Returns the step's loss (the total of named ones), for the step row."""
        if type(loss) is not torch.Tensor and not isinstance(loss, torch.Tensor):  # (1st: no call)
            loss = self.stack_named(loss)  # named losses: the total first, then each
        if summed:  # reported per sample (float64: no rounding)
            loss = loss.double() / step_samples
        self.losses.append(loss)
        if self.positions is not None:
            self.positions.append(self.steps)
        self.sizes.append(samples)
        self.weights.append(step_samples / processes)
        self.steps += 1
        return loss[0] if loss.ndim else loss

    def stack_named(self, losses: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A train_step's named losses as one tensor: their total first (``"loss"``, else
        their sum), then each in ``names`` order (the same names every step)."""
        names = [name for name in losses if name != "loss"]
        if self.names and names != self.names:
            raise GlassloopError(
                f"train_step returned the losses {names} after {self.names}: return the same "
                "names every step"
            )
        self.names = names
        values = [torch.as_tensor(losses[name]).detach().float() for name in names]
        total = torch.as_tensor(losses["loss"]).detach().float() if "loss" in losses else None
        return torch.stack([sum(values) if total is None else total, *values])  # type: ignore[list-item]

    def add_correct(self, counts: torch.Tensor) -> None:
        """A step's ``[correct, counted]`` labels (kept on the device, as the losses)."""
        self.correct = counts if self.correct is None else self.correct + counts

    def end_epoch(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.losses, self.weights, self.sizes, self.steps = [], [], [], 0
        self.positions, self.correct = None, None

    def mean_loss(self) -> float | None:
        """This process's mean training loss of the epoch so far (a host sync), for the
        progress bar; ``None`` before the first step."""
        if not self.losses:
            return None
        weights = torch.tensor(self.weights, dtype=torch.float64, device=self.losses[0].device)
        totals = torch.stack([loss[0] if loss.ndim else loss for loss in self.losses])
        return float(totals.to(torch.float64) @ weights / weights.sum())

    def accuracy(self) -> float | None:
        """This process's running training accuracy of the epoch so far (a host sync), for
        the progress bar; ``None`` when not counted or nothing counted yet."""
        if self.correct is None:
            return None
        correct, counted = self.correct.tolist()
        return correct / counted if counted else None

    def step_losses(self, world: World) -> list[float]:
        """Every step's loss of the epoch so far, each as its step row gives it
        (:func:`step_loss`), in one host read (several processes: one collective): what the
        report's per-step plot draws, whatever ``log_every`` is. NaN for a step no process
        holds."""
        totals = [loss[0] if loss.ndim else loss for loss in self.losses]
        known = self.positions is not None or len(totals) <= self.steps  # (else: see below)
        if not world.distributed and self.positions is None and known:  # each step once
            return torch.stack(totals).cpu().tolist() if totals else []
        # Each process holds its share of a step's loss times the number of processes (a
        # resume by fewer: several processes' in one): their sum over the processes that
        # wrote it, divided by how many did. The last column: processes whose losses have
        # no known steps (a checkpoint of an older glassloop resumed at another number of
        # processes mid-epoch): then no row at all, never a wrong one.
        sums = torch.zeros(2, self.steps + 1, dtype=torch.float64)
        sums[0, -1] = float(not known)
        if totals and known:
            at = torch.tensor(self.positions if self.positions is not None else range(len(totals)))
            sums[0].index_add_(0, at, torch.stack(totals).double().cpu())
            sums[1].index_add_(0, at, torch.ones(len(totals), dtype=torch.float64))
        if world.distributed:
            sums = all_reduce(sums)
        if sums[0, -1]:
            return []
        return [s / n if n else float("nan") for s, n in zip(*sums[:, :-1].tolist(), strict=True)]

    def train_loss(
        self, world: World, device: torch.device, *, accuracy: bool = False
    ) -> dict[str, float]:
        """The epoch's mean training loss over every process's samples (``train_loss``; NaN
        when every step of the epoch was skipped) and each named loss's (``train_<name>``);
        with ``accuracy``, the share of every process's counted labels its steps' outputs
        got right (``train_accuracy``, in the same collective)."""
        keys = ["train_loss", *(f"train_{name}" for name in self.names)]
        sums = torch.zeros(len(keys) + 1, dtype=torch.float64)  # (none: a resume's other ranks)
        if self.losses:
            weights = torch.tensor(self.weights, dtype=torch.float64, device=device)
            means = torch.stack(self.losses).to(torch.float64).reshape(len(self.losses), -1)
            sums = torch.cat([weights @ means, weights.sum().reshape(1)]).cpu()
        if accuracy:  # [correct, counted] after them (none counted: a resume's other ranks)
            counts = self.correct.cpu() if self.correct is not None else torch.zeros(2)
            sums = torch.cat([sums, counts.to(torch.float64)])
        if world.distributed:  # the mean over every process's samples
            sums = all_reduce(sums)
        row = {key: float("nan") for key in keys}  # every step of the epoch skipped
        if sums[len(keys)]:
            row = {key: float(sums[i] / sums[len(keys)]) for i, key in enumerate(keys)}
        if accuracy:
            correct, counted = sums[-2:].tolist()
            row["train_accuracy"] = correct / counted if counted else float("nan")
        return row

    def _steps(self) -> dict[str, Any]:
        return {
            "epoch_losses": torch.stack(self.losses).cpu() if self.losses else None,
            **({"epoch_loss_names": list(self.names)} if self.names else {}),
            "epoch_sizes": list(self.sizes),
            "epoch_weights": list(self.weights),
            "epoch_steps": self.steps,
            **({"epoch_positions": list(self.positions)} if self.positions is not None else {}),
            **({"epoch_correct": self.correct.tolist()} if self.correct is not None else {}),
        }

    def state_dict(self, world: World | None = None) -> dict[str, Any]:
        """This epoch's steps so far (with several processes every process's: each holds
        its own share of every step's loss; a collective then), its RNG and the history."""
        state = {**self._steps(), "epoch_rng": self.epoch_rng, "history": self.history}
        if world is not None and world.distributed:
            from glassloop.distributed.world import gather_objects

            state["epoch_per_rank"] = gather_objects(self._steps())
        return state

    def load_state_dict(
        self, state: dict[str, Any], device: torch.device, world: World | None = None
    ) -> None:
        per_rank = state.get("epoch_per_rank") or [state]  # (one process: its own, at the top)
        size, rank = (world.size, world.rank) if world is not None else (1, 0)
        # This process's own steps, or, written by another number of processes, merged.
        steps = per_rank[rank] if len(per_rank) == size else _merged(per_rank, size, rank)
        losses = steps["epoch_losses"]
        self.losses = list(losses.to(device).unbind()) if losses is not None else []
        self.names = [str(name) for name in steps.get("epoch_loss_names", [])]
        self.sizes = [int(n) for n in steps["epoch_sizes"]]
        # (checkpoints written before weights were kept: each step weighed its samples)
        self.weights = [float(w) for w in steps.get("epoch_weights", self.sizes)]
        self.steps = int(steps.get("epoch_steps", len(self.losses)))
        positions = steps.get("epoch_positions")
        self.positions = [int(i) for i in positions] if positions is not None else None
        correct = steps.get("epoch_correct")
        self.correct = None if correct is None else torch.tensor(correct, device=device)
        self.epoch_rng = state.get("epoch_rng")
        self.history = list(state["history"])


def _merged(per_rank: list[dict[str, Any]], size: int, rank: int) -> dict[str, Any]:
    """The epoch's steps of a checkpoint written by another number of processes, for process
    ``rank`` of ``size``: every saved process's losses with their weights on rank 0 (the
    epoch's mean is a weighted sum over all processes, so where the terms sit does not
    change it) and none elsewhere; the samples done so far shared out evenly (the bar)."""
    done = sum(int(n) for steps in per_rank for n in steps["epoch_sizes"])
    share = [done // size + (r < done % size) for r in range(size)]
    merged: dict[str, Any] = {"epoch_losses": None, "epoch_sizes": [share[rank]] if done else []}
    merged["epoch_loss_names"] = per_rank[0].get("epoch_loss_names", [])
    merged["epoch_weights"], merged["epoch_positions"] = [], []  # (the steps to come: appended)
    first = per_rank[0]  # (every saved process recorded the same steps)
    losses = first["epoch_losses"]
    merged["epoch_steps"] = first.get("epoch_steps", 0 if losses is None else len(losses))
    if rank == 0:
        counts = [s["epoch_correct"] for s in per_rank if s.get("epoch_correct") is not None]
        if counts:  # train_accuracy's labels: every saved process's, added up
            merged["epoch_correct"] = [sum(c[0] for c in counts), sum(c[1] for c in counts)]
        kept = [s["epoch_losses"] for s in per_rank if s["epoch_losses"] is not None]
        merged["epoch_losses"] = torch.cat(kept) if kept else None
        merged["epoch_weights"] = [
            float(w) for s in per_rank for w in s.get("epoch_weights", s["epoch_sizes"])
        ]
        merged["epoch_positions"] = [  # each saved process's steps, for the per-step losses
            int(i)
            for s in per_rank
            if s["epoch_losses"] is not None
            for i in s.get("epoch_positions", range(len(s["epoch_losses"])))
        ]
    return merged


def step_loss(loss: torch.Tensor, world: World) -> float:
    """A step's loss as one process would log it (a host read). With several processes each
    holds its samples' share of the whole window's loss times the number of processes (see
    ``Trainer._window``): their sum over processes, divided by that number, is the loss of
    every sample of the step."""
    if not world.distributed:
        return loss.item()
    # (float64: three or more processes' float32 shares add up exactly in any order, so the
    # epoch's every step losses, reduced as one vector, give the same values)
    return float(all_reduce(loss.detach().double().cpu().reshape(1))) / world.size


@dataclass
class SaveTimes:
    """How long each checkpoint held up the step and how long it took to commit."""

    blocking_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    active: bool = True  # a run that can save (one with a run directory)
    held_s: float = 0.0  # what the steps waited for checkpoints since the last epoch row
    graced: bool = False  # the first save's time was said against train.grace_s

    def row(self) -> dict[str, float]:
        """An epoch row's ``checkpoint_s``: the seconds the steps waited for checkpoints
        since the previous row (an epoch's own end is in the next row's)."""
        held, self.held_s = self.held_s, 0.0
        return {"checkpoint_s": round(held, 6)} if self.active else {}

    def add(self, blocking: float, total: float, nbytes: int) -> None:
        self.blocking_s.append(blocking)
        self.total_s.append(total)
        self.nbytes.append(nbytes)

    def against_grace(self, grace_s: float) -> str | None:
        """Once, when the first save's time is known (a background one's: at a later look):
        that time against ``grace_s`` (``train.grace_s``; 0: nothing to say), with a warning
        when a stop signal's save would not land before the SIGKILL that follows it."""
        if not grace_s or self.graced or not self.total_s:
            return None
        self.graced, took = True, self.total_s[0]
        if took <= grace_s:
            return f"checkpoint: {took:.2f} s to save, within train.grace_s = {grace_s:g} s"
        return (
            f"warning: a checkpoint takes {took:.1f} s, more than train.grace_s = "
            f"{grace_s:g} s: a stop signal's save would be killed before it lands (the "
            "previous checkpoint stays the latest); ask the scheduler for a longer grace "
            "(Slurm: --signal=USR1@SECONDS; Kubernetes: terminationGracePeriodSeconds); "
            "until then a preempted run resumes from its last periodic checkpoint"
        )

    def summary(self) -> dict[str, float | int] | None:
        """Counts, medians and the write speed (``None`` before the first save)."""
        if not self.total_s:
            return None
        blocking, total = sorted(self.blocking_s), sorted(self.total_s)
        return {
            "saves": len(total),
            "blocking_s": round(blocking[len(blocking) // 2], 4),
            "total_s": round(total[len(total) // 2], 4),
            "gb_per_s": round(sum(self.nbytes) / max(sum(self.total_s), 1e-9) / 1e9, 6),
        }
