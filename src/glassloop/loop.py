"""The training loop: ``Trainer.fit`` runs epochs; ``Trainer.train_step`` is one optimizer step."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

from glassloop.batch import Inputs, batch_size_of, describe, split_batch
from glassloop.callbacks import Callback
from glassloop.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointWriteError,
    checkpoints_dir,
    clean_temporaries,
    find_resumable,
    load_weights,
    prune,
    read_checkpoint,
    save_best,
    save_checkpoint,
    save_weights,
    step_dir_name,
    step_dirs,
    unwrap_model,
    weights_metadata,
    write_failure,
    write_json,
)
from glassloop.config import CheckpointConfig, config_differences
from glassloop.device import move_to_device, resolve_device
from glassloop.distributed import (
    World,
    all_reduce,
    barrier,
    gather_objects,
    local_device,
    world_from_env,
    wrap,
)
from glassloop.errors import ConfigError, DataError, GlassloopError, ModelError, NonFiniteError
from glassloop.evaluation import LossFn, evaluate, predict
from glassloop.precision import autocast, check_precision, make_scaler
from glassloop.preemption import Preempted, StopSignals
from glassloop.provenance import environment
from glassloop.rng import (
    capture_loader_rng,
    capture_rng_state,
    restore_loader_rng,
    restore_rng_state,
    seed_everything,
)
from glassloop.run_lock import RunLock
from glassloop.serialization import stable_repr
from glassloop.sinks import ConsoleSink, CSVSink, JSONLSink, TensorBoardSink, truncate_rows
from glassloop.state import TrainState

SCHEDULER_INTERVALS = ("epoch", "step")
CSV_FIELDS = [
    "kind", "epoch", "step", "samples", "train_loss", "loss", "lr", "grad_norm", "samples_per_s",
    "seconds",
]  # fmt: skip


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``loss_fn`` and evaluates it.

    What ``fit`` does, in order (the code below reads the same way)::

        restore the checkpoint if resuming           # weights, optimizer, RNG, data position
        for epoch in range(state.epoch, epochs):
            model.train()
            for batch in train_loader:              # iterated exactly as given
                x, y = batch moved to device
                loss = loss_fn(model(x), y)         # forward, loss
                loss.backward()                     # backward
                optimizer.step()                    # update
                optimizer.zero_grad()
                scheduler.step() if interval == "step"
                checkpoint every n steps; on SIGTERM/SIGINT: checkpoint and stop
            val = evaluate(val_loader)              # eval mode, no grad, mean over samples
            scheduler.step() if interval == "epoch"
            history.append({train_loss, val_loss, val_accuracy, lr, seconds})
            checkpoint every n epochs; RUN_DIR/best/ when checkpoint.monitor improved
        checkpoint; RUN_DIR/model.safetensors

    Example::

        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                          nn.CrossEntropyLoss())
        history = trainer.fit(train_loader, val_loader, epochs=10)
        probs = trainer.predict(x_new)

    ``seed`` seeds python/numpy/torch here, after the model was built; to make the initial
    weights reproducible call :func:`glassloop.seed_everything` before building the model.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        scheduler: Any = None,
        scheduler_interval: str = "epoch",
        device: str | torch.device = "auto",
        seed: int | None = None,
        progress: str = "auto",
        log_every: int = 100,
        run_dir: str | Path | None = None,
        callbacks: Sequence[Callback] = (),
        precision: str = "32",
        grad_accum_steps: int = 1,
        loss_weighting: str = "samples",
        ignore_index: int = -100,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        nonfinite: str = "raise",
        max_nonfinite_skips: int = 10,
        ema_decay: float | None = None,
        compile: bool = False,
        compile_mode: str = "default",
        compile_dynamic: bool = False,
        world: World | None = None,
        tensorboard: bool = False,
        checkpoint: CheckpointConfig | None = None,
        config: Mapping[str, Any] | None = None,
        model_spec: Mapping[str, Any] | None = None,
    ) -> None:
        if scheduler_interval not in SCHEDULER_INTERVALS:
            raise GlassloopError(
                f"scheduler.interval must be 'epoch' or 'step', got {scheduler_interval!r}"
            )
        if log_every < 1:
            raise GlassloopError(f"train.log_every must be >= 1, got {log_every}")
        if grad_accum_steps < 1:
            raise GlassloopError(f"train.grad_accum_steps must be >= 1, got {grad_accum_steps}")
        if loss_weighting not in ("samples", "tokens"):
            raise GlassloopError(
                f"train.loss_weighting must be 'samples' or 'tokens', got {loss_weighting!r}"
            )
        if nonfinite not in ("raise", "skip"):
            raise GlassloopError(f"train.nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise GlassloopError(f"train.ema_decay must be in (0, 1), got {ema_decay}")
        if seed is not None:
            seed_everything(seed)
        # Several processes (torchrun): this one's rank, and its own device.
        self.world = world if world is not None else world_from_env()
        self.device = local_device(resolve_device(device), self.world)
        check_precision(precision, self.device)
        model = model.to(self.device)
        # torch.compile wraps the module (state_dict keys gain "_orig_mod."); checkpoints
        # store the unwrapped keys, so they load with or without compile. dynamic=False: one
        # static graph per input shape. Dynamo's default ("automatic dynamic") switches to a
        # dynamic graph after the second shape it sees (the short last batch), so which
        # kernels run depends on the order a process met the shapes in, which a resumed
        # process does not repeat (a max weight diff of 0.018 was reported on a resume).
        self.model: nn.Module = (
            cast(nn.Module, torch.compile(model, mode=compile_mode, dynamic=compile_dynamic))
            if compile
            else model
        )
        # DistributedDataParallel with several processes: gradients are averaged across them
        # during backward (once per optimizer step, see no_sync in train_step).
        self.model = wrap(self.model, self.world, self.device)
        self.precision = precision
        self.scaler = make_scaler(precision, self.device)
        self.grad_accum_steps = grad_accum_steps
        self.loss_weighting = loss_weighting
        self.ignore_index = ignore_index
        self.clip_grad_norm = clip_grad_norm or None
        self.clip_grad_value = clip_grad_value or None
        self.nonfinite = nonfinite
        self.max_nonfinite_skips = max_nonfinite_skips
        # An exponential moving average of the weights (torch's AveragedModel): evaluated
        # and exported instead of the raw weights when enabled.
        self.ema: AveragedModel | None = None
        if ema_decay:
            average = get_ema_multi_avg_fn(ema_decay)  # type: ignore[no-untyped-call]
            self.ema = AveragedModel(model, multi_avg_fn=average, use_buffers=True)
        self.last_grad_norm: torch.Tensor | None = None
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.log_every = log_every
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.callbacks = list(callbacks)
        self.checkpoint = checkpoint if checkpoint is not None else CheckpointConfig()
        self.config = dict(config) if config is not None else None
        # How to rebuild the model from its weights file alone (glassloop.load_model).
        self.model_spec = dict(model_spec) if model_spec is not None else None
        # Only rank 0 talks: the other processes print nothing at all.
        self.console = ConsoleSink(progress, silent=not self.world.is_main)
        self.state = TrainState()
        self.history: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] | None = None
        self.should_stop = False
        self._sinks: list[CSVSink | JSONLSink | TensorBoardSink] = []
        self.tensorboard = tensorboard  # also log to RUN_DIR/tensorboard/
        self._signals = StopSignals()
        self._train_loader: Iterable[Any] = ()
        self._environment: dict[str, Any] = {}
        self._epoch_losses: list[torch.Tensor] = []
        # A loader without state_dict (a DataLoader, a list): the RNG it drew this epoch's
        # order from, so a resume can replay the epoch exactly (see _replay).
        self._epoch_rng: dict[str, Any] | None = None
        self._epoch_sizes: list[int] = []
        self._last_log = (time.perf_counter(), 0)
        self._checked_first_batch = False
        self._failure: str | None = None  # the error a failed fit ended with, for run.json
        self._window_samples = 0
        # Under DDP: the signal the processes agreed on in this step's collective (None: no
        # collective ran, e.g. an overridden train_step; the stop check then runs its own).
        self._agreed_signal: int | None = None

    # ----------------------------------------------------------------------------- the step
    def train_step(self, window: Sequence[tuple[Inputs, Any]]) -> torch.Tensor | None:
        """One optimizer step over a window of micro-batches; returns the window's detached
        loss, or ``None`` when the step was skipped (non-finite loss with
        ``nonfinite="skip"``, or an fp16 overflow).

        ``window`` holds ``grad_accum_steps`` ``(inputs, target)`` pairs (fewer at the end of an
        epoch). Override this method to change what a step does; ``fit`` stays the same.
        """
        weights = self._loss_weights(window)
        window_loss: torch.Tensor | None = None
        last = len(window) - 1
        for i, (((args, kwargs), target), weight) in enumerate(zip(window, weights, strict=True)):
            # DDP: all-reduce gradients only on the window's last micro-batch (no_sync is
            # entered once and spans its forward and backward).
            sync = (
                self.model.no_sync()  # type: ignore[operator]
                if self.world.distributed and i != last
                else contextlib.nullcontext()
            )
            with sync:
                with autocast(self.precision, self.device):
                    output = self.model(*args, **kwargs)  # forward
                    loss = self.loss_fn(output, target)
                if weight is not None:
                    # This micro-batch's share of the window (its samples or tokens over the
                    # window's), so the summed gradients equal those of one big batch, also
                    # for the last, shorter window of an epoch.
                    loss = loss * weight
                detached = loss.detach()
                window_loss = detached if window_loss is None else window_loss + detached
                if self.scaler is not None:
                    loss = self.scaler.scale(loss)  # fp16: keep small gradients representable
                loss.backward()  # type: ignore[no-untyped-call]  # gradients add up in .grad
        assert window_loss is not None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # true gradients for clipping and the norm
        # Read every step: parameters unfrozen after the Trainer was built are clipped too.
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.clip_grad_value:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        grad_size = None
        if self.clip_grad_norm:
            # Returns the norm before clipping: what is logged as grad_norm.
            grad_size = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            self.last_grad_norm = grad_size
        elif self.scaler is None and params:  # (fp16: the scaler skips inf gradients itself)
            # Fused L2 norms (one kernel on GPU; 51 us/step on the tutorial MLP on this CPU;
            # the inf-norm would be 885 us): finite exactly when every gradient is.
            grads = [p.grad for p in params if p.grad is not None]
            grad_size = torch.stack(torch._foreach_norm(grads)).sum()
        # One host sync checks the loss and the gradients (a sum is finite only if both are;
        # item() is ~25x cheaper than torch.isfinite on a CPU scalar): the price of never
        # stepping on a NaN, also one with a finite loss.
        check = window_loss if grad_size is None else window_loss + grad_size
        finite = math.isfinite(check.item())
        if self.world.distributed:
            # Every process must take the same decisions: one collective carries "was any
            # loss non-finite" and "did any process get SIGTERM/SIGINT" (acted on after the step).
            signum = self._signals.received or 0
            flags = all_reduce(torch.tensor([float(not finite), float(signum)]), "max")
            finite, self._agreed_signal = not flags[0].item(), int(flags[1].item())
        if not finite:
            self._nonfinite(window_loss, len(window))
            if self.scaler is not None:
                self.scaler.update()  # closes this step's unscale_() (and lowers the scale)
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.state.consecutive_nonfinite = 0
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # optimizer.step(), unless fp16 grads overflowed
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # the scale drops only on a skipped step
        else:
            self.optimizer.step()  # exactly torch's step: nothing wrapped, nothing skipped
            stepped = True
        self.optimizer.zero_grad(set_to_none=True)  # None frees memory; next backward writes
        if not stepped:
            self.state.skipped_steps += 1
            return None
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()  # once per optimizer step, never for a skipped one
        return window_loss

    def _loss_weights(self, window: Sequence[tuple[Inputs, Any]]) -> list[float | None]:
        """Each micro-batch's weight in its window: ``None`` for a window of one in one
        process (the loss is used as is), else its samples (or non-ignored tokens) over the
        window's across all processes, times the number of processes (DDP averages
        gradients over processes; this turns that average into the sample-weighted one)."""
        if len(window) == 1 and not self.world.distributed:
            return [None]
        if self.loss_weighting == "tokens":
            counts = [int((target != self.ignore_index).sum()) for _, target in window]
        else:
            counts = [batch_size_of(target, inputs) for inputs, target in window]
        total = sum(counts)
        if self.world.distributed:
            samples = sum(batch_size_of(target, inputs) for inputs, target in window)
            totals = all_reduce(torch.tensor([total, samples], dtype=torch.float64))
            total, self._window_samples = int(totals[0]), int(totals[1])
        scale = self.world.size
        return [scale * count / total if total else 0.0 for count in counts]

    def _nonfinite(self, loss: torch.Tensor, num_batches: int) -> None:
        """Apply ``nonfinite``: raise with where it happened, or count a skipped step."""
        state = self.state
        first, last = state.batch_in_epoch + 1, state.batch_in_epoch + num_batches
        batches = f"batch {last}" if first == last else f"batches {first}-{last}"
        where = f"step {state.step + 1} (epoch {state.epoch + 1}, {batches})"
        bad = next(
            (
                name
                for name, p in self.model.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ),
            None,
        )
        culprit = f"; first non-finite gradient: '{bad}'" if bad else ""
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"train: loss is {loss.item()} at {where}{culprit}. Lower the learning rate, "
                "clip gradients (train.clip_grad_norm), check the data for NaN/inf, or set "
                "train.nonfinite = 'skip'"
            )
        state.skipped_steps += 1
        state.consecutive_nonfinite += 1
        if state.consecutive_nonfinite >= self.max_nonfinite_skips:
            raise NonFiniteError(
                f"train: {state.consecutive_nonfinite} non-finite steps in a row, the last at "
                f"{where}{culprit}; stopping (train.max_nonfinite_skips = "
                f"{self.max_nonfinite_skips})"
            )

    # ------------------------------------------------------------------------------ the loop
    def fit(
        self,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None = None,
        *,
        epochs: int,
        resume: str | Path | None = None,
        allow_config_change: bool = False,
    ) -> list[dict[str, Any]]:
        """Train until ``epochs`` epochs are done; return the history, one dict per epoch.

        ``train_loader`` is any iterable of batches (a ``DataLoader``, a list, ...) and is
        iterated exactly as given. ``resume="auto"`` continues from the newest valid
        checkpoint in ``run_dir`` (or starts fresh if there is none); a path resumes from that
        checkpoint. Resume is exact when the loader has ``state_dict``/``load_state_dict``
        (:class:`glassloop.data.ResumableLoader`); other loaders replay the epoch's first
        batches. SIGTERM/SIGINT stop after the current step with a checkpoint and raise
        :class:`glassloop.Preempted`.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise GlassloopError(f"train.epochs must be a positive integer, got {epochs!r}")
        self.should_stop = False
        self._checked_first_batch = False
        self._train_loader = train_loader
        # Versions and git SHA for run.json and checkpoint metadata (a git subprocess: only
        # worth it when something is written).
        self._environment = environment() if self.run_dir is not None else {}
        with self._own_run_dir():
            if self.run_dir is not None and self.world.is_main:
                clean_temporaries(self.run_dir)
            barrier()  # nobody reads the run dir while rank 0 tidies it
            if resume is not None:
                self._resume(resume, allow_config_change)
            elif self.run_dir is not None and step_dirs(self.run_dir):
                raise CheckpointError(
                    f"checkpoint: '{self.run_dir}' already holds checkpoints; pass "
                    "resume='auto' (--resume) to continue that run, or choose another run_dir"
                )
            if self.state.epoch >= epochs or self.state.stopped:
                self._finish_again(epochs)
                return self.history
            self._train(train_loader, val_loader, epochs)
        return self.history

    def _train(
        self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int
    ) -> None:
        """The epochs, between opening and closing the run directory's files."""
        if self.precision == "fp16" and self.device.type == "cpu":
            self.console.message(
                "warning: fp16 on a CPU is emulated and slow (11x slower than '32' on the "
                "tutorial MLP in docs/benchmarks.md); 'bf16' is the CPU's mixed precision"
            )
        self._open_run_dir(val_loader is not None)
        status = "failed"
        try:
            with StopSignals() as self._signals:
                for callback in self.callbacks:
                    callback.on_fit_start(self)
                while self.state.epoch < epochs and not self.should_stop:
                    row = self._run_epoch(train_loader, val_loader, epochs)
                    self._end_epoch(row, epochs)
                for callback in self.callbacks:
                    callback.on_fit_end(self)
                self.save_checkpoint(finished=True)  # always at the end
            status = "finished"
        except (KeyboardInterrupt, Preempted):
            status = "interrupted"
            raise
        except Exception as err:
            self._failure = f"{type(err).__name__}: {err}"
            raise
        finally:
            self.console.close()
            self._close_run_dir(status)

    def _run_epoch(
        self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int
    ) -> dict[str, Any]:
        state = self.state
        epoch = state.epoch + 1
        start = time.perf_counter()
        self.console.epoch_start(epoch, epochs, _num_samples(train_loader))
        self.model.train()  # dropout on, batch-norm updates its running statistics
        if state.batch_in_epoch == 0:  # a fresh epoch (a resumed one keeps its sums)
            self._epoch_losses, self._epoch_sizes = [], []
        losses, sizes = self._epoch_losses, self._epoch_sizes
        batches: Iterable[Any] = train_loader
        if not hasattr(train_loader, "load_state_dict"):
            if state.batch_in_epoch:  # resumed inside this epoch
                batches = self._replay(train_loader, state.batch_in_epoch)
            else:  # what the loader's order will be drawn from (kept in checkpoints)
                self._epoch_rng = capture_loader_rng(train_loader)
        every_n_steps = self.checkpoint.every_n_steps if self.run_dir is not None else 0
        batch: Any = None
        window: list[tuple[Inputs, Any]] = []
        try:
            for batch in batches:
                window.append(split_batch(move_to_device(batch, self.device)))
                if len(window) == self.grad_accum_steps:
                    self._step_window(window, losses, sizes, every_n_steps)
                    window = []
            if window:  # the epoch's last, partial accumulation window
                self._step_window(window, losses, sizes, every_n_steps)
        except (RuntimeError, IndexError, ValueError) as err:
            explained = self._explain(err, batch)
            if explained is err:
                raise
            raise explained from err
        if state.batch_in_epoch == 0:
            raise DataError(
                "data: the training loader yielded no batches (an empty dataset, or "
                "batch_size larger than the dataset with drop_last=True)"
            )
        train_loss = float("nan")  # every step of the epoch was skipped
        epoch_samples = sum(sizes)
        if losses:
            weights = torch.tensor(sizes, dtype=torch.float64, device=self.device)
            loss_sum = torch.stack(losses).to(torch.float64) @ weights
            if self.world.distributed:  # the mean over every process's samples
                sums = all_reduce(torch.stack([loss_sum, weights.sum()]).cpu())
                loss_sum, weights = sums[0], sums[1:]
            epoch_samples = int(weights.sum())
            train_loss = float(loss_sum) / epoch_samples
        row: dict[str, Any] = {
            "kind": "epoch",
            "epoch": epoch,
            "step": state.step,
            "samples": state.samples_seen,
            "train_loss": train_loss,
        }
        if val_loader is not None:
            self.last_eval = self.evaluate(val_loader)
            row.update({f"val_{k}": v for k, v in self.last_eval.items() if _is_scalar(v)})
        row["lr"] = self.optimizer.param_groups[0]["lr"]
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.scheduler.step(row.get("val_loss", train_loss))
            else:
                self.scheduler.step()
        state.epoch = epoch
        state.batch_in_epoch = 0
        self._epoch_losses, self._epoch_sizes = [], []
        if self.last_grad_norm is not None:
            row["grad_norm"] = float(self.last_grad_norm)  # of the epoch's last step
        if self.device.type == "cuda":  # peak memory of this process's GPU
            row["max_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        row["seconds"] = time.perf_counter() - start
        row["samples_per_s"] = epoch_samples / row["seconds"] if row["seconds"] > 0 else None
        return row

    def _replay(self, loader: Iterable[Any], num_batches: int) -> Iterator[Any]:
        """Continue a loader without ``state_dict`` inside an epoch: with the RNG it drew the
        epoch's order from put back (global and its own generator: a ``DataLoader`` draws
        its shuffle and worker seeds from them), load and drop the batches already trained
        on, then put back the RNG of the checkpoint. Exact for a ``DataLoader`` and for any
        loader whose order depends on nothing else."""
        now = capture_loader_rng(loader)
        if self._epoch_rng is not None:
            restore_loader_rng(loader, self._epoch_rng)
        iterator = iter(loader)
        for _ in itertools.islice(iterator, num_batches):
            pass
        restore_loader_rng(loader, now)
        return iterator

    def _step_window(
        self,
        window: list[tuple[Inputs, Any]],
        losses: list[torch.Tensor],
        sizes: list[int],
        every_n_steps: int,
    ) -> None:
        """Run one optimizer step on ``window`` and do the bookkeeping around it."""
        state = self.state
        if not self._checked_first_batch:
            self._checked_first_batch = True
            self._check_batch(*window[0])
        n = sum(batch_size_of(target, inputs) for inputs, target in window)
        self._agreed_signal = None
        loss = self.train_step(window)
        # Samples of every process (counted in train_step's all-reduce under DDP).
        state.samples_seen += self._window_samples if self.world.distributed else n
        state.batch_in_epoch += len(window)
        self.console.advance(n)
        if loss is None:  # skipped: nothing learned, no step counted
            return
        losses.append(loss)  # kept on the device: no host sync per step
        sizes.append(n)
        state.step += 1
        if (len(losses) - 1) % self.log_every == 0:  # the tutorial's "batch % 100 == 0"
            self._log_step(loss, sum(sizes))
        if every_n_steps and state.step % every_n_steps == 0:
            self.save_checkpoint()
        self._stop_if_signalled(agreed=self._agreed_signal)

    def _end_epoch(self, row: dict[str, Any], epochs: int) -> None:
        """Record the epoch, let callbacks see it, track the best, checkpoint per policy."""
        self.history.append(row)
        self._write_row(row)
        self.console.epoch_end(row, epochs)
        for callback in self.callbacks:
            callback.on_epoch_end(self, row)
        self.state.stopped = self.should_stop  # a stopped run stays finished on resume
        if self._update_best(row) and self.run_dir is not None:
            # best/ before the epoch's checkpoint: a kill in between resumes before this
            # epoch, which then writes both again, so they never disagree for good.
            state = self.state_dict()  # collective: every process takes part
            if self.world.is_main:
                self._check_run_dir()
                save_best(self.run_dir, self.model, state, self._meta(finished=False))
        every = self.checkpoint.every_n_epochs
        if every and self.state.epoch % every == 0:
            self.save_checkpoint()
        self._stop_if_signalled()

    def _update_best(self, row: dict[str, Any]) -> bool:
        monitor = self.checkpoint.monitor
        if not monitor:
            return False
        if monitor not in row:
            names = sorted(k for k, v in row.items() if _is_scalar(v) and k != "epoch")
            raise ConfigError(
                f"config: checkpoint.monitor {monitor!r} is not a metric of this run "
                f"(available: {', '.join(names)})"
            )
        value = float(row[monitor])
        mode = self.checkpoint.mode
        if mode == "auto":
            mode = "max" if "accuracy" in monitor or "f1" in monitor else "min"
        best = self.state.best_metric
        if best is not None and not (value > best if mode == "max" else value < best):
            return False
        self.state.best_metric = value
        return True

    def _stop_if_signalled(self, agreed: int | None = None) -> None:
        """Stop after this step if a SIGTERM/SIGINT arrived (in any process: all processes
        agree on the step, so the checkpoint is consistent). ``agreed`` is the signal the
        processes already agreed on in this step's collective."""
        signum = self._signals.received or 0
        if self.world.distributed:
            if agreed is None:
                agreed = int(all_reduce(torch.tensor([signum]), "max").item())
            signum = agreed
        if signum:
            self._preempt(signum)

    def _preempt(self, signum: int) -> None:
        path = self.save_checkpoint() if self.run_dir is not None else None
        raise Preempted(signum, self.state.step, str(path) if path is not None else None)

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs (see :mod:`checkpoint`)."""
        loader = self._train_loader
        return {
            "loop": self.state.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "ema": self.ema.state_dict() if self.ema is not None else None,
            # The current epoch's per-step losses, so its train_loss is exact after a resume.
            "epoch_losses": torch.stack(self._epoch_losses) if self._epoch_losses else None,
            "epoch_sizes": list(self._epoch_sizes),
            "epoch_rng": self._epoch_rng,
            "history": self.history,
            "rng": capture_rng_state(),
            # Every process's RNG (dropout masks differ per process); a collective call.
            "rng_per_rank": gather_objects(capture_rng_state()) if self.world.distributed else None,
            "data": loader.state_dict() if hasattr(loader, "state_dict") else None,
            "callbacks": [
                cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.callbacks
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the global RNGs last, right before training goes on."""
        self.state.load_state_dict(state["loop"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        losses = state["epoch_losses"]
        self._epoch_losses = list(losses.to(self.device).unbind()) if losses is not None else []
        self._epoch_sizes = [int(n) for n in state["epoch_sizes"]]
        self._epoch_rng = state.get("epoch_rng")
        self.history = list(state["history"])
        loader = self._train_loader
        if state["data"] is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state["data"])
        for callback, saved in zip(self.callbacks, state["callbacks"], strict=False):
            if saved is not None and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(saved)
        per_rank = state.get("rng_per_rank")
        restore_rng_state(per_rank[self.world.rank] if per_rank else state["rng"])

    def save_checkpoint(self, *, finished: bool = False) -> Path | None:
        """Commit a checkpoint of the current step under ``run_dir`` (None without one)."""
        if self.run_dir is None:
            return None
        state = self.state_dict()  # collective (RNG of every process): all processes call it
        path = checkpoints_dir(self.run_dir) / step_dir_name(self.state.step)
        failure: Exception | None = None
        if self.world.is_main:  # one writer; the others wait for its verdict below
            try:
                self._check_run_dir()
                path = save_checkpoint(
                    self.run_dir, self.model, state, self._meta(finished=finished)
                )
                prune(self.run_dir, self.checkpoint.keep_last)
            except GlassloopError as err:
                failure = err
        if self.world.distributed:
            failed = all_reduce(torch.tensor([float(failure is not None)]), "max").item()
            if failed and failure is None:
                raise CheckpointError(f"checkpoint: rank 0 could not write '{path}'; see its error")
        if failure is not None:
            raise failure
        return path

    def _meta(self, *, finished: bool) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "world_size": self.world.size,
            "step": self.state.step,
            "epoch": self.state.epoch,
            "batch_in_epoch": self.state.batch_in_epoch,
            "finished": finished,
            "metrics": self.history[-1] if self.history else None,
            "config": self.config or self._describe(),
            "model_spec": self.model_spec,
            "versions": self._environment,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def _resume(self, resume: str | Path, allow_config_change: bool) -> None:
        if str(resume) == "auto":
            if self.run_dir is None:
                raise GlassloopError("resume='auto' needs a run_dir to look for checkpoints in")
            found, problems = find_resumable(self.run_dir)
            if found is None and problems:
                # Never restart over checkpoints that a user may want to repair or inspect.
                raise CheckpointError(
                    f"checkpoint: no valid checkpoint to resume in '{self.run_dir}' (nothing "
                    f"was changed): {' | '.join(problems)}"
                )
            for problem in problems:
                self.console.message(f"warning: {problem}; falling back to an older checkpoint")
            if found is None:
                self.console.message(
                    f"no checkpoint in '{self.run_dir / 'checkpoints'}'; starting at step 0"
                )
                return
            checkpoint = found
        else:
            checkpoint = read_checkpoint(Path(resume))  # named explicitly: no fallback
        saved_world = checkpoint.meta.get("world_size", 1)  # checked to be an int >= 1
        if saved_world != self.world.size:
            raise ConfigError(
                f"config: '{checkpoint.path}' was written by {saved_world} process(es), this "
                f"job has {self.world.size}; resume with the same number (--nproc "
                f"{saved_world}): each process's data shard and RNG are part of the state"
            )
        saved = checkpoint.meta.get("config")
        current = self.config or self._describe()
        changes = config_differences(saved, current)
        if changes and not allow_config_change:
            raise ConfigError(
                f"config: the run in '{checkpoint.path}' was made with a different config: "
                f"{'; '.join(changes)}. Resuming would not continue the same run; pass "
                "--allow-config-change (allow_config_change=True) to resume anyway"
            )
        load_weights(self.model, checkpoint.weights)
        try:
            self.load_state_dict(checkpoint.state)
        except (KeyError, ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(
                f"checkpoint: '{checkpoint.path}' does not fit this trainer: "
                f"{type(err).__name__}: {err}"
            ) from err
        loader = self._train_loader
        exact = hasattr(loader, "load_state_dict") or isinstance(loader, (DataLoader, list, tuple))
        if self.state.batch_in_epoch and not exact:
            self.console.message(
                f"warning: the training loader ({type(loader).__name__}) has no "
                f"load_state_dict(); resuming replays the first {self.state.batch_in_epoch} "
                "batches of the epoch with the RNG of the epoch's start, exact only if its "
                "order depends on nothing else (glassloop.data loaders, DataLoader and "
                "lists resume exactly)"
            )
        self.console.message(
            f"resumed from '{checkpoint.path}' at step {self.state.step} (epoch "
            f"{self.state.epoch + 1}, batch {self.state.batch_in_epoch})"
        )

    def _log_step(self, loss: torch.Tensor, seen_in_epoch: int) -> None:
        value = loss.item()  # a host sync, only every log_every steps
        self.console.log_step(value, seen_in_epoch)
        now, samples = time.perf_counter(), self.state.samples_seen
        last_time, last_samples = self._last_log
        self._last_log = (now, samples)
        row = {
            "kind": "step",
            "epoch": self.state.epoch + 1,
            "step": self.state.step,
            "samples": samples,
            "loss": value,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(self.last_grad_norm) if self.last_grad_norm is not None else None,
            "samples_per_s": (samples - last_samples) / (now - last_time) if last_samples else None,
        }
        self._write_row(row)

    def _check_batch(self, inputs: Inputs, target: Any) -> None:
        """Cheap checks on the first batch of a fit, each with one clear error: inputs free of
        NaN/inf, integer class labels, labels within the model's outputs.

        The labels are checked against an eval-mode, no-grad forward of the unwrapped model:
        no dropout, no batch-norm update, no RNG draw, so training is not changed by it.
        """
        args, kwargs = inputs
        for name, value in [*enumerate(args), *kwargs.items()]:
            floating = isinstance(value, torch.Tensor) and value.is_floating_point()
            if floating and not bool(torch.isfinite(value).all()):
                raise DataError(
                    f"data: the first training batch has NaN or inf in input {name!r}; "
                    "clean or impute the data before training"
                )
        if not isinstance(target, torch.Tensor) or target.is_floating_point():
            return  # regression or soft targets: nothing to check here
        model = unwrap_model(self.model)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), autocast(self.precision, self.device):
                output = model(*args, **kwargs)
        finally:
            model.train(was_training)
        if not isinstance(output, torch.Tensor) or output.ndim != target.ndim + 1:
            return
        classes = int(output.shape[1] if output.ndim == 2 else output.shape[-1])
        labels = target[target != self.ignore_index]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
            raise DataError(
                f"data: labels in the first training batch range over [{int(labels.min())}, "
                f"{int(labels.max())}] but the model has {classes} outputs; labels must be "
                f"class indices in [0, {classes}) (or {self.ignore_index} to ignore)"
            )

    def _explain(self, err: Exception, batch: Any) -> Exception:
        """Turn a torch error caused by the user's data or model into one clear line."""
        if isinstance(err, GlassloopError):
            return err
        text = " ".join(str(err).split())
        where = f"epoch {self.state.epoch + 1}, batch {self.state.batch_in_epoch + 1}"
        if "out of bounds" in text and "arget" in text:
            return DataError(
                f"data: a label is outside the model's output range ({text}) at {where}; "
                "labels must be in [0, num_outputs)"
            )
        if self.state.step == 0:
            return ModelError(
                f"model: the first batch {describe(batch)} was rejected by the model or loss: "
                f"{type(err).__name__}: {text}"
            )
        return err

    # ------------------------------------------------------------------------ eval / predict
    @property
    def eval_model(self) -> nn.Module:
        """What is evaluated and exported: the EMA of the weights when enabled, else the model."""
        if self.ema is not None:
            return self.ema.module
        # Evaluation needs no gradient sync: the module under DDP, each process on its shard.
        return self.model.module if isinstance(self.model, DDP) else self.model

    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]:
        """Loss (mean over samples), accuracy, confusion matrix and per-class report."""
        with autocast(self.precision, self.device):
            return evaluate(self.eval_model, loader, self.loss_fn, device=self.device)

    def predict(self, data: torch.Tensor | Iterable[Any], *, batch_size: int = 256) -> torch.Tensor:
        """Softmax probabilities, on the CPU, under ``torch.inference_mode``."""
        with autocast(self.precision, self.device):
            return predict(self.eval_model, data, batch_size=batch_size, device=self.device)

    # ------------------------------------------------------------------------------ run dir
    def _open_run_dir(self, has_val: bool) -> None:
        if self.run_dir is None or not self.world.is_main:  # rank 0 writes the run's files
            return
        fields = list(CSV_FIELDS)
        if has_val:
            fields[5:5] = ["val_loss", "val_accuracy"]
        fresh = self.state.step == 0  # a new run replaces the metrics of one that never saved
        try:
            if not fresh:  # rows a killed process wrote after its last checkpoint go
                truncate_rows(self.run_dir, self.state.step)
            write_json(self.run_dir / "config.json", self.config or self._describe())
            write_json(self.run_dir / "run.json", {"status": "running", **self._environment})
            self._sinks = [
                CSVSink(self.run_dir / "metrics.csv", fields, fresh=fresh),
                JSONLSink(self.run_dir / "metrics.jsonl", fresh=fresh),
            ]
        except OSError as err:
            raise write_failure(self.run_dir, err) from err
        if self.tensorboard:
            self._sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))

    def _write_row(self, row: dict[str, Any]) -> None:
        """One metrics row to every sink; a full disk is a write failure (exit 3)."""
        try:
            for sink in self._sinks:
                sink.write(row)
        except OSError as err:
            assert self.run_dir is not None  # sinks exist only with a run directory
            raise write_failure(self.run_dir, err) from err

    def _close_run_dir(self, status: str) -> None:
        """Final weights (when finished) and run.json. A write failure is a
        :class:`CheckpointWriteError` (exit 3); while another error is already on its way
        out, a failure here is only reported, so that error is the one the user sees."""
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self.run_dir is None or not self.world.is_main:
            return
        try:
            self._check_run_dir()
            if status == "finished":
                self._write_final_weights()
            info = {"status": status, "step": self.state.step, "epoch": self.state.epoch}
            if self._failure is not None and status == "failed":
                info["error"] = self._failure
            write_json(self.run_dir / "run.json", {**info, **self._environment})
        except (OSError, CheckpointError) as err:
            failure = write_failure(self.run_dir, err)
            if status == "finished":
                raise failure from err
            self.console.message(f"warning: {failure}")

    def _write_final_weights(self) -> None:
        assert self.run_dir is not None
        metadata = weights_metadata(self.model_spec)
        save_weights(self.eval_model, self.run_dir / "model.safetensors", metadata)

    def _check_run_dir(self) -> None:
        """Refuse to write into a run directory that disappeared during the run (never
        recreate it half-empty, without its config and metrics)."""
        if self.run_dir is not None and not self.run_dir.is_dir():
            raise CheckpointWriteError(
                f"checkpoint: the run directory '{self.run_dir}' disappeared during the run "
                "(deleted or unmounted?); not recreating it without its config and metrics"
            )

    @contextlib.contextmanager
    def _own_run_dir(self) -> Iterator[None]:
        """Create the run directory and hold its lock (rank 0) for the whole ``fit``."""
        if self.run_dir is None or not self.world.is_main:
            yield
            return
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise GlassloopError(f"run: '{self.run_dir}' is a file, not a run directory")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            lock = RunLock(self.run_dir)
            lock.acquire()
        except OSError as err:
            raise write_failure(self.run_dir, err) from err
        try:
            yield
        finally:
            lock.release()

    def _finish_again(self, epochs: int) -> None:
        """Resuming a finished run: complete whatever final file a kill left unwritten
        (finishing is idempotent), then stop."""
        state = self.state
        why = "stopped early" if state.stopped else "already finished"
        missing = []
        if self.run_dir is not None and self.world.is_main:
            try:
                if not (self.run_dir / "model.safetensors").is_file():
                    self._write_final_weights()
                    missing.append("model.safetensors")
                if _run_status(self.run_dir) != "finished":
                    info = {"status": "finished", "step": state.step, "epoch": state.epoch}
                    write_json(self.run_dir / "run.json", {**info, **self._environment})
                    missing.append("run.json")
            except OSError as err:
                raise write_failure(self.run_dir, err) from err
        done = f"; wrote what its end left out: {', '.join(missing)}" if missing else ""
        self.console.message(
            f"run {why} at step {state.step} (epoch {state.epoch}/{epochs}); nothing to do{done}"
        )

    def _describe(self) -> dict[str, Any]:
        """The configuration of a run built in Python, for runs without a config file."""
        return {
            "model": type(unwrap_model(self.model)).__name__,
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "optimizer": type(self.optimizer).__name__,
            "optimizer_defaults": {
                k: _jsonable(v) for k, v in sorted(self.optimizer.defaults.items())
            },
            "loss_fn": stable_repr(self.loss_fn),
            "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "scheduler_interval": self.scheduler_interval,
            "precision": self.precision,
            "grad_accum_steps": self.grad_accum_steps,
            "loss_weighting": self.loss_weighting,
            "clip_grad_norm": self.clip_grad_norm,
            "clip_grad_value": self.clip_grad_value,
            "ema_decay": self.ema is not None,
            "compile": self.model is not unwrap_model(self.model),
            "device": str(self.device),
        }


def _num_samples(loader: Iterable[Any]) -> int | None:
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return stable_repr(value)


def _run_status(run_dir: Path) -> str | None:
    try:
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info.get("status") if isinstance(info, dict) else None
