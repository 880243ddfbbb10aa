"""The training loop, one class: :class:`Trainer`. Its constructor, then the loop in the order
it runs (``fit`` → ``_run_epoch`` → ``_step_window`` → ``train_step``), then checkpoint state,
``evaluate`` and ``predict``; each other job is one call into a part (``Checkpointer``,
``RunLog``, ``Validator``, guards), its options one table (:mod:`glassloop.options`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import glassloop.distributed.fsdp as fsdp
import glassloop.distributed.world as distributed
import glassloop.evaluation.evaluate as evaluation
import glassloop.options as options
import glassloop.step.guards as guards
import glassloop.step.optim as optimizers
import glassloop.tasks as tasks
from glassloop.batch import Inputs, split_batch
from glassloop.callbacks import Callback
from glassloop.checkpoint.checkpointer import Checkpointer
from glassloop.data.position import epoch_batches, take_loader
from glassloop.deprecated import fold_replaced, warn_replaced
from glassloop.device import move_to_device
from glassloop.distributed.preemption import Preempted, StopRequested, StopSignals
from glassloop.errors import GlassloopError
from glassloop.evaluation.evaluate import LossFn, Metric
from glassloop.evaluation.validator import Validation, Validator
from glassloop.options import CheckpointConfig, RunInfo, TrackingConfig
from glassloop.precision import autocast, check_precision, make_scaler
from glassloop.rng import seed_everything, use_deterministic
from glassloop.run_dir.run import RunDir
from glassloop.state import EpochRecord, TrainState, step_loss
from glassloop.step.gradient_flow import GradientFlow
from glassloop.step.micro_batches import MicroBatches
from glassloop.step.optim import Schedulers, optimizer_parameters
from glassloop.step.parallelize import averaged, evaluated, place
from glassloop.step.profiling import StepProfiler, fit_profiler
from glassloop.step.throughput import Throughput, peak_flops
from glassloop.step.window import StepLoss, Window, Windows
from glassloop.storage.redaction import redacted
from glassloop.tasks import model_loss
from glassloop.tracking.console import ProgressReporter
from glassloop.tracking.notebook import Evaluation, History, trainer_html
from glassloop.tracking.provenance import environment
from glassloop.tracking.run_log import RunLog, python_config
from glassloop.tracking.summary import end_summary, samples_in, shown_path, start_header


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
                checkpoint every n steps; on SIGTERM/INT/USR1/USR2: checkpoint and stop
            val = evaluate(val_loader)              # eval mode, no grad, mean over samples
            scheduler.step() if interval == "epoch"
            history.append({train_loss, val_loss, val_accuracy, lr, seconds})
            RUN_DIR/best/ when checkpoint.monitor improved; checkpoint every n epochs
        checkpoint; RUN_DIR/model.safetensors

    Every argument is described below (each option's text in :mod:`glassloop.options`); the
    README and docs/python-api.md begin with one in use.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Mapping[str, Any],
        loss_fn: LossFn | None,
        *,
        # the model, its loss and what it is for
        task: str | Mapping[str, str] = "auto",
        outputs: str = "auto",
        metrics: Sequence[str] | Mapping[str, Metric | str] | None = None,
        train_accuracy: bool = False,
        # the step
        precision: str = "32",
        grad_accum_steps: int = 1,
        micro_batch_size: int | str = 0,
        loss_weighting: str = "samples",
        loss_reduction: str = "auto",
        ignore_index: int = -100,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        nonfinite: str | guards.NonFinitePolicy = "raise",
        loss_spike: float = 0.0,
        ema_decay: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        activation_checkpointing: Sequence[str] = (),
        scheduler: Any = None,  # (or a dict of them)
        scheduler_interval: str = "epoch",
        # the epoch
        validate_every_n_steps: int = 0,
        limit_batches: int = 0,
        seed: int | None = None,
        deterministic: bool | str = False,
        callbacks: Sequence[Callback] = (),
        # where it runs
        device: str | torch.device = "auto",
        world: distributed.World | None = None,
        strategy: str = "auto",
        # the run directory
        run_dir: str | Path | None = None,
        checkpoint: CheckpointConfig | None = None,
        run_info: RunInfo | None = None,
        tensorboard: bool = False,
        tracking: TrackingConfig | None = None,
        progress: str = "auto",
        log_every: int = 100,
        stop_signals: Sequence[str] = ("TERM", "INT", "USR1", "USR2"),
        grace_s: float = 0.0,
        profile: int = 0,
        **replaced: Any,  # names replaced during 0.1 (glassloop.deprecated), with a warning
    ) -> None:
        # The arguments, before any other local is set: each option against its rule (as a
        # config's), and what a run built in Python records.
        options.check_options(locals())
        self.options = {name: value for name, value in locals().items() if name in options.OPTIONS}
        policy, compiled, run_info = fold_replaced(replaced, nonfinite, compile, run_info, locals())
        guards.check_model(model)  # its own train()/eval() in place of nn.Module's, no weights
        self.optimizer = optimizers.one_optimizer(optimizer)  # several by name (a GAN's): one
        self.scheduler = Schedulers(scheduler) if isinstance(scheduler, Mapping) else scheduler
        self.loss_fn, self.precision = loss_fn, precision
        self.scheduler_interval = scheduler_interval
        # What the model is trained to do (glassloop.tasks), or each head's: what predict
        # returns, the metrics and the checks.
        told = tasks.resolve(task, loss_fn, model, outputs, loss_reduction, train_accuracy)
        self.task, self.heads, self.probabilities = told.task, told.heads, told.probabilities
        self.loss_reduction, self.train_accuracy = told.loss_reduction, told.train_accuracy
        self.summed = self.loss_reduction == "sum"  # (read every step: an attribute)
        self.metrics = evaluation.metric_table(metrics, self.task, self.heads)
        self.validate_every_n_steps, self.limit_batches = validate_every_n_steps, limit_batches
        self.grad_accum_steps, self.loss_weighting = grad_accum_steps, loss_weighting
        self.ignore_index, self.nonfinite, self.log_every = ignore_index, policy, log_every
        self.clip_grad_norm = clip_grad_norm or None  # (0: off, recorded as None)
        self.clip_grad_value = clip_grad_value or None
        self.ema_decay = ema_decay or None
        self.stop_signals = stop_signals  # each stops the run after a step, with a checkpoint
        self.grace_s = grace_s  # what a scheduler leaves before SIGKILL (said at the first save)
        self.profile = profile  # steps to profile (0: none): glassloop.step.profiling
        self.callbacks = list(callbacks)
        self.state, self.record = TrainState(), EpochRecord()  # where the loop is, what it saw
        # What the run records and compares on resume (secrets in URIs replaced by ***).
        config, spec = run_info.config, run_info.model_spec
        self.config = redacted(dict(config)) if config is not None else None
        self.info = RunInfo(self.config, dict(spec) if spec is not None else None)  # (+ fit's)
        if seed is not None:
            seed_everything(seed)
        self.deterministic = use_deterministic(deterministic)  # "on", "warn" or "off"
        # Where it runs (glassloop.step.parallelize): its processes (torchrun's: their group
        # joined), this process's device, the model on it, compiled, under DDP or FSDP2
        # (sharded: an FSDP run's weights and optimizer state, which checkpoints save).
        how: dict[str, Any] = {"precision": precision, "compile": compiled, "ema": bool(ema_decay)}
        self.world, self.device, self.model, self.sharded = place(
            model, self.optimizer, device, world, strategy, activation_checkpointing, **how
        )
        self.distributed = self.world.distributed  # (read every step: an attribute)
        self.precision_note = check_precision(precision, self.device)
        self._parameters = list(self.model.parameters())
        optimizers.check_kernels(self.optimizer)  # on the device: capturable=True needs a GPU
        self._step_parts(micro_batch_size, loss_spike)
        self._run_parts(run_dir, checkpoint, tracking)
        self._signals, self._train_loader = StopSignals(), cast(Iterable[Any], ())  # fit's
        self.validator = Validator(None)  # fit's validation sets (glassloop.evaluation.validator)

    def _step_parts(self, micro_batch_size: int | str, loss_spike: float) -> None:
        """What the step uses besides the model and optimizer: the fp16 scaler, the closure
        an optimizer like LBFGS steps with, the micro-batches, the non-finite guard, the
        EMA of the weights and how each step's window is weighted."""
        self.scaler = make_scaler(self.precision, self.device)
        self.fp16 = self.scaler.is_enabled()  # (off: the step calls none of the scaler)
        self.autocast = autocast(self.precision, self.device)  # (reusable: entered each forward)
        # LBFGS & co.: step(closure) evaluates forward, loss and backward itself.
        clipping, processes = bool(self.clip_grad_norm or self.clip_grad_value), self.world.size
        self.closure_step = optimizers.closure_step(
            self.optimizer, self.precision, clipping, self.nonfinite.policy, processes
        )
        # each batch split into micro-batches that fit ("auto": found in the first steps)
        sharded, closure = self.sharded is not None, self.closure_step
        self.micro_batches = MicroBatches(micro_batch_size, sharded=sharded, closure=closure)
        # The default: NaN/inf noticed on the device, read where the loop reads anyway (no
        # host sync per step); "strict", "skip" and fp16 (its scaler reads) check each step.
        self.watch = guards.NonFiniteWatch(spike=loss_spike)  # (and finite spikes, when asked)
        self.deferred_check = self.nonfinite.policy == "raise" and not self.fp16
        self.watch_only = self.deferred_check and not (self.clip_grad_norm or self.clip_grad_value)
        # An exponential moving average of the weights (torch's AveragedModel): evaluated
        # and exported instead of the raw weights when enabled.
        self.ema = averaged(self.model, self.ema_decay) if self.ema_decay else None
        tokens = self.loss_weighting == "tokens" and self.loss_reduction == "mean"
        how = (self.summed, tokens, self.ignore_index, self.loss_fn is None)
        where: dict[str, Any] = {"precision": self.precision, "device": self.device}
        self.windows = Windows(self.model, self.world, *how, **where)

    def _run_parts(
        self,
        run: str | Path | None,
        policy: CheckpointConfig | None,
        tracking: TrackingConfig | None,
    ) -> None:
        """The run directory (its lock, remote copy and save times: :mod:`glassloop.run_dir.
        run`), handed once to its two writers: the run log (its files, and every row to each
        destination, the console too: only rank 0 talks) and the checkpointer."""
        self.run = RunDir(run, self.world)
        self.run_dir = self.run.path
        progress, silent = self.options["progress"], not self.world.is_main
        self.console = ProgressReporter(progress, silent=silent, record=self.record)
        writes = {"tensorboard": self.options["tensorboard"], "tracking": tracking}
        self.run_log = RunLog(self.run, self.console, state=self.state, info=self.info, **writes)
        # weights no gradient reaches, named after a fresh run's first steps (a warning)
        self.gradient_flow = GradientFlow(self.model, self.console.message, self.loss_fn)
        self.checkpointer = Checkpointer(
            self.run,
            policy,
            model=self.model,
            shards=self.sharded,
            record=self.record,
            callbacks=self.callbacks,
            watch=self.watch,
            info=self.info,
            device=self.device,
            say=self.console.message,
            grace_s=self.grace_s,
        )

    def fit(
        self,
        train_loader: Iterable[Any],
        val_loader: Validation | None = None,
        *,
        epochs: int,
        batch_size: int | None = None,
        resume: str | Path | None = None,
        allow_config_change: bool = False,
    ) -> History:
        """Train until ``epochs`` epochs are done; return the history, one dict per epoch.

        ``train_loader``: any iterable of batches, iterated as given, or a Hugging Face dataset
        (``batch_size`` rows a batch, 64); ``val_loader``: one, or several by name. ``resume``:
        ``"auto"`` (the newest valid checkpoint in ``run_dir``; none: fresh) or a path, exactly;
        a job torchrun restarted resumes by itself. A stop signal (``stop_signals``) stops it
        after the current step with a checkpoint and raises :class:`glassloop.Preempted`.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise GlassloopError(f"train.epochs must be a positive integer, got {epochs!r}")
        # (a Trainer may fit again) should_stop: set by callbacks to end it after this epoch
        self.should_stop, self._checked_first_batch = False, False
        resume = "auto" if resume is None and distributed.restarted() else resume  # (torchrun's)
        # sharded; a dataset in glassloop's loader (data.hf_datasets); a new Trainer: epoch 0
        train_loader, val_loader = take_loader(self, train_loader, val_loader, batch_size)
        self._train_loader = train_loader
        lm, peak = self.task == "language-model", peak_flops(self.device, self.precision)
        self.throughput = Throughput(tokens=lm, peak=peak, world=self.world)  # samples/s, MFU
        self.validator = Validator(
            val_loader,
            limit=self.limit_batches,
            counted=self.sharded is not None,
            every=self.validate_every_n_steps,
            sinks=(self.run_log.write,),  # mid-epoch rows
        )
        # The config a resume compares (without a config file: the Trainer's options), the
        # versions and git SHA (a git subprocess: only worth it when something is written).
        self.info.config = self.config or python_config(self)
        self.info.versions = environment(self.deterministic) if self.run_dir else {}
        self._attached()  # what a save holds
        with self.run.hold(self.checkpointer.usable):  # its lock, for the whole fit
            distributed.barrier()  # nobody reads the run dir while rank 0 tidies it
            self.checkpointer.resume(resume, epochs=epochs, allow_config_change=allow_config_change)
            if self.state.epoch >= epochs or self.state.stopped:
                # resuming a finished run: complete any final file a kill left unwritten
                self.console.message(self.run_log.finish_again(self.eval_model, epochs))
            else:
                self._train(train_loader, epochs)
        return self.history

    def _train(self, train_loader: Iterable[Any], epochs: int) -> None:
        """The epochs, between opening and closing the run directory's files."""
        for note in (self.precision_note, self.micro_batches.note(self.task, self.loss_weighting)):
            if note:  # fp16 on a CPU; a language model's batches split by rows
                self.console.message(note)
        first_val = self.validator.first
        self.run_log.start(has_val=first_val is not None)
        self.watch.check(self.state, self.world)  # counts from here (a resumed run's step)
        self.state.began = time.perf_counter()  # the run's training time: from the header
        self.gradient_flow.start(fresh=self.state.step == 0, sharded=self.sharded is not None)
        status, pairs = "failed", None  # pairs: a regression's outputs and targets, plotted
        self._failure: str | None = None  # the error a failed fit ends with, for run.json
        self.profiler: StepProfiler | None = fit_profiler(
            self.profile, self.world, self.run_dir, self.console.message
        )
        try:
            profiling = self.profiler or contextlib.nullcontext()
            with StopSignals(self.stop_signals) as self._signals, profiling:
                # (from the header on, a stop signal ends the run with a checkpoint)
                self.console.info(start_header(self, train_loader, first_val, epochs))
                for callback in self.callbacks:
                    callback.on_fit_start(self)
                while self.state.epoch < epochs and not self.should_stop:
                    try:
                        row = self._run_epoch(train_loader, epochs)
                    except StopRequested as stop:  # in a validation or a wait for data
                        self._stop_if_signalled(stop.signum)  # (agreed: raises Preempted)
                    self._end_epoch(row, epochs)
                for callback in self.callbacks:
                    callback.on_fit_end(self)
                self.checkpointer.save(finished=True)  # always at the end
            status = "finished"
            if self.task == "regression" and self.run_dir:  # every process: its shard
                pairs = self.validator.outputs(self)
        except (KeyboardInterrupt, Preempted):
            status = "interrupted"
            raise
        except Exception as err:
            self._failure = f"{type(err).__name__}: {err}"
            raise
        finally:
            self.console.close()
            self.checkpointer.close()  # a save in flight commits before the end
            # The clocks stop; the final weights and run.json, then the final report.
            last: dict[str, Any] = {"evaluation": self.last_eval, "predicted_vs_true": pairs}
            report = self.run_log.finish(status, self.eval_model, error=self._failure, **last)
        self.console.info(end_summary(self, report))

    def _run_epoch(self, train_loader: Iterable[Any], epochs: int) -> dict[str, Any]:
        state, start = self.state, time.perf_counter()
        epoch = state.epoch + 1
        done = sum(self.record.sizes)  # a resumed epoch's bar starts where it was
        self.throughput.start(done)
        self.console.epoch_start(epoch, epochs, samples_in(train_loader), done)
        self.model.train()  # dropout on, batch-norm updates its running statistics
        if state.validation_due == "step":  # a stop signal cut it short: it comes first
            self.validator.mid_epoch(self, state)
        # The epoch's batches from where it is (a resume), from one iter() of the loader, and
        # what its order is drawn from (data.position; one process: a stop signal cuts a long
        # wait for data short); none when a stop signal cut the epoch's validation short.
        batches: Iterable[Any] = ()
        if state.validation_due != "epoch":
            signals, window, rng = self._signals, self.grad_accum_steps, self.record.epoch_rng
            batches, self.record.epoch_rng = epoch_batches(
                train_loader, rng, state, self.limit_batches, signals, window, self.world
            )
        batch: Any = None
        micro: list[tuple[Inputs, Any]] = []
        own = self.loss_fn is None  # the model computes its loss: it also gets labels=target
        try:
            for batch in batches:
                micro.append(split_batch(move_to_device(batch, self.device), labels_to_model=own))
                if len(micro) == self.grad_accum_steps:
                    self._step_window(micro)
                    micro = []
            if micro:  # the epoch's last, partial accumulation window
                self._step_window(micro)
            if self.limit_batches and hasattr(train_loader, "finish_epoch"):
                train_loader.finish_epoch()  # a limited epoch is the first N of its order
            self.throughput.stop()
        except (RuntimeError, IndexError, ValueError, AssertionError, TypeError) as err:
            explained = guards.explain(err, batch, state)  # (an assert: torch.optim's only)
            if explained is err:
                raise
            raise explained from err
        self.watch.check(state, self.world)  # before anything of the epoch is recorded
        guards.check_batches(state.batch_in_epoch)  # (an empty loader: one clear line)
        row: dict[str, Any] = {"kind": "epoch", "epoch": epoch, "step": state.step}
        row["samples"] = state.samples_seen
        # train_loss (and a train_step's named losses: train_<name>), over every process
        row.update(self.record.train_loss(self.world, self.device, accuracy=self.train_accuracy))
        state.validation_due = "epoch"  # (a stop signal inside it: validated again on resume)
        row.update(self.validator.row(self))  # val_* (nothing without a validation set)
        row["lr"] = self.optimizer.param_groups[0]["lr"]
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            optimizers.step_per_epoch(self.scheduler, row)  # ReduceLROnPlateau: on val_loss
        # (an epoch's end, in every checkpoint)
        state.epoch, state.batch_in_epoch, state.validation_due = epoch, 0, ""
        if state.grad_norm is not None:
            row["grad_norm"] = float(state.grad_norm)  # of the epoch's last step
        row["seconds"] = time.perf_counter() - start
        row.update(self.checkpointer.times.row())  # checkpoint_s: the steps' wait for saves
        # samples/s (tokens/s, MFU) of the training part; a GPU's peak memory
        row.update(self.throughput.row(sum(self.record.sizes), self.device))
        return row

    def _step_window(self, micro: list[tuple[Inputs, Any]]) -> None:
        """One optimizer step on ``micro`` and the bookkeeping around it."""
        state = self.state
        if not self._checked_first_batch:
            self._checked_first_batch = True
            self.check_first_batch(*micro[0])
        # train_accuracy's [right, counted] labels, counted by its first forward_backward
        self._correct: torch.Tensor | None = None
        # (micro_batch_size: split; several processes: the stop signal any of them got)
        window, signum = self.windows.make(micro, self._signals.received, self.micro_batches.rows)
        if self.micro_batches.trials_left:  # "auto", a first step: out of memory halves, retried
            loss, window, signum = self.micro_batches.first_step(self, micro, window, signum)
        elif self.throughput.counting:  # a fit's first step: its FLOPs, for MFU (GPU only)
            loss = self.throughput.count(self.train_step, window, micro)
        else:
            loss = self.train_step(window)
        if self.throughput.tokens:
            self.throughput.add(micro)  # a language model's tokens, for tokens/s
        state.samples_seen += window.samples
        state.batch_in_epoch += len(micro)
        if self.console.epoch_bar is not None:  # (no bar: no call)
            self.console.advance(window.local)  # this process's samples (.samples: every one's)
        if loss is not None:  # None: skipped, nothing learned, no step counted
            if self.scheduler is not None and self.scheduler_interval == "step":
                self.scheduler.step()  # once per optimizer step, never for a skipped one
            total = self.record.add_step(  # (named losses: their total)
                loss, window.local, window.samples, self.world.size, summed=self.summed
            )
            state.step += 1
            if self._correct is not None:  # train_accuracy: the step's right labels count
                self.record.add_correct(self._correct)
            if self.watch.spike:  # checked with the non-finite values, without a host read
                self.watch.observe_step(total, state, len(micro))
            if self.profiler is not None:
                self.profiler.step()
            if (self.record.steps - 1) % self.log_every == 0:  # the tutorial's "% 100"
                self._log_step(total)
            for callback in self.callbacks:
                callback.on_step_end(self, state.step, total)
            if self.validator.every and state.step % self.validator.every == 0:
                self.validator.mid_epoch(self, state)  # (validate_every_n_steps)
            if self.checkpointer.due_after_step(state.step):
                self.checkpointer.save()
        if signum or self._signals.received:  # (none: no call)
            self._stop_if_signalled(signum)

    def train_step(self, window: Window) -> StepLoss:
        """One optimizer step over ``window`` (``grad_accum_steps`` micro-batches, fewer at the
        end of an epoch); returns the window's detached loss, or ``None`` when the step was
        skipped (a non-finite loss or gradient with ``nonfinite="skip"``, an fp16 overflow).

        Override it to change what a step does: everything it needs comes in ``window``
        (micro-batches, loss weights, sample count) and ``self`` (model, optimizer, ...);
        :meth:`backward` and :meth:`step` are the loop's own (scaler, clipping, the
        non-finite check). Return the loss, or a dict of named losses (each reported as
        ``train_<name>``; ``train_loss`` is ``"loss"``, else their sum), or ``None``, and
        ``fit`` does the rest (the scheduler's step included).
        """
        if self.closure_step:  # LBFGS & co.: the optimizer runs forward, loss, backward
            evaluate = functools.partial(self.forward_backward, window, True)
            window_loss = cast(torch.Tensor, self.optimizer.step(evaluate))  # type: ignore[arg-type]
            self.optimizer.zero_grad(set_to_none=True)
            self.watch.observe(window_loss)  # (nonfinite="raise" only: the others are refused)
        else:
            window_loss = self.forward_backward(window)  # forward, loss, backward
            if not self.step(self.optimizer, window_loss, len(window.batches)):
                return None  # skipped: nothing learned
        return window_loss

    def forward_backward(self, window: Window, zero_grad: bool = False) -> torch.Tensor:
        """Forward, loss and backward of each micro-batch of ``window``, the gradients adding
        up in ``.grad``; the window's loss, detached. ``zero_grad``: the gradients are set
        to None first (a closure an optimizer calls several times per step, e.g. LBFGS)."""
        if zero_grad:
            self.optimizer.zero_grad(set_to_none=True)
        window_loss: torch.Tensor | None = None
        counting = self.train_accuracy and self._correct is None  # (once a step: LBFGS, a retry)
        last = len(window.batches) - 1
        for i, ((args, kwargs), target) in enumerate(window.batches):
            # Several processes: gradients are reduced across them only in the window's last
            # micro-batch's backward (DDP's no_sync, FSDP's requires_gradient_sync).
            with fsdp.gradient_sync(self.model, i == last):
                with self.autocast:
                    output = self.model(*args, **kwargs)  # forward
                    # The model's own loss (e.g. a Hugging Face model given labels) or ours.
                    loss = (
                        model_loss(output) if self.loss_fn is None else self.loss_fn(output, target)
                    )
                if counting:  # the labels it got right (on the device, no host read)
                    counts = tasks.correct_labels(output, target, self.ignore_index)
                    self._correct = counts if self._correct is None else self._correct + counts
                if (weight := window.weights[i]) is not None:
                    # Its share of the window's samples (tokens): the summed gradients are one
                    # big batch's, also in an epoch's last, shorter window.
                    loss = loss * weight
                detached = loss.detach()
                window_loss = detached if window_loss is None else window_loss + detached
                self.backward(loss)
        assert window_loss is not None
        return window_loss

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the loop does it: under fp16 the loss is scaled first, so
        small gradients stay representable (:meth:`step` unscales them)."""
        scaled = self.scaler.scale(loss) if self.fp16 else loss  # (fp32: no call)
        scaled.backward()  # type: ignore[no-untyped-call]  # adds up in .grad

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, batches: int = 1) -> bool:
        """``optimizer.step()`` as the loop takes it: unscale (fp16), clip, check ``loss`` and
        the gradients (``nonfinite``; ``batches``: named when not finite), step,
        ``zero_grad``, the EMA. ``False``: the step was skipped (nothing changed)."""
        if self.watch_only:  # the default: the loss checked later, on the device
            self.watch.observe(loss)  # (read at the next step row, checkpoint or epoch end)
        elif not self._clip_and_check(loss, optimizer):  # a NaN/inf loss or gradient: no step
            self.nonfinite(self.model, loss, self.state, batches)
            self.scaler.update()  # closes this step's unscale_() (fp16: lowers the scale)
            optimizer.zero_grad(set_to_none=True)
            return False
        self.state.consecutive_nonfinite = 0
        if self.gradient_flow.pending:  # a fresh run's first steps: weights left without one
            self.gradient_flow.check(optimizer)
        if self.fp16:  # optimizer.step() unless the gradients overflowed; the scale adapts
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # None frees memory; next backward writes
        if self.fp16 and self.scaler.get_scale() < scale:  # it drops only on a skipped step
            self.state.skipped_steps += 1
            return False
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return True

    def _clip_and_check(self, window_loss: torch.Tensor, optimizer: Any) -> bool:
        """Unscale (fp16) and clip ``optimizer``'s gradients; whether the loss and gradients
        are finite, decided alike in every process."""
        self.scaler.unscale_(optimizer)  # fp16: true gradients for clipping and the check
        # Every parameter with a gradient, frozen ones too (one unfrozen later is clipped and
        # checked); the list is kept (walking the module tree each step: ~4 us, small model).
        own = self._parameters if optimizer is self.optimizer else optimizer_parameters(optimizer)
        params = [p for p in own if p.grad is not None]
        if self.clip_grad_value:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        checked = [window_loss]  # the loss and the gradient norms, read together
        if self.clip_grad_norm:
            # Returns the norm before clipping: what is logged as grad_norm.
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
            self.state.grad_norm = fsdp.full(norm)  # FSDP: the norm over every process's shard
            checked.append(self.state.grad_norm)
        if self.deferred_check:  # read at the next step row, checkpoint or epoch end
            self.watch.observe(*checked)
            return True
        # "strict", "skip", fp16: decided now, alike in every process (fp16: the scaler
        # checks the gradients itself; a clipped norm is finite exactly when they all are).
        gradients = params if not self.clip_grad_norm and not self.fp16 else []
        return guards.all_finite(checked, gradients, self.world, sharded=self.sharded is not None)

    def _end_epoch(self, row: dict[str, Any], epochs: int) -> None:
        """Record the epoch, let callbacks see it, track the best, checkpoint per policy."""
        for callback in self.callbacks:  # before the row is written: they may add to it
            callback.on_epoch_end(self, row)
        self.run_log.write_losses(row, self.record)  # every step's, for the report
        self.record.end_epoch(row)
        self.run_log.write(row)  # (to every destination: the files, the console, ...)
        self.state.stopped = self.should_stop  # a stopped run stays finished on resume
        best = self.checkpointer.better(row, self.state.best_metric)
        if best is not None:
            self.state.best_metric = best
            # best/ before the epoch's checkpoint: a kill in between resumes before this
            # epoch, which then writes both again, so they never disagree for good.
            self.checkpointer.save(best=True)
        if self.checkpointer.due_after_epoch(self.state.epoch):
            self.checkpointer.save()
        self.run_log.report(self.last_eval)  # when due: a long run's live view
        self._stop_if_signalled()

    def _stop_if_signalled(self, agreed: int | None = None) -> None:
        """Checkpoint and stop after this step if any process got a stop signal (``agreed``:
        in this step's collective), every process at the same step."""
        signum = self._signals.received or 0
        if self.distributed and agreed is not None:
            signum = agreed  # this step's collective's
        elif self.distributed:  # an epoch's end: one collective now
            signum = int(distributed.all_reduce(torch.tensor([signum]), "max"))
        if signum:
            started = time.perf_counter()
            path = self.checkpointer.save(wait=True)  # (async: committed before the end)
            where = shown_path(self.run, path.parents[1], path) if path else None  # (a URL)
            raise Preempted(signum, self.state.step, where, time.perf_counter() - started)

    def _log_step(self, loss: torch.Tensor) -> None:
        self.checkpointer.poll()  # (a background save that failed stops the run here)
        self.watch.check(self.state, self.world)  # (a NaN since the last row stops here)
        value = step_loss(loss, self.world)  # a host sync, only every log_every steps
        norm = None if self.state.grad_norm is None else float(self.state.grad_norm)
        self.run_log.write_step(loss=value, lr=self.optimizer.param_groups[0]["lr"], grad_norm=norm)

    # ------------------------------------------------------------ around the loop: hooks
    def check_first_batch(self, inputs: Inputs, target: Any) -> None:
        """The first-batch guard (:func:`glassloop.step.guards.check_first_batch`; the rest:
        :func:`glassloop.doctor`). Override it to replace it, or with ``pass`` to switch it
        off (e.g. for a model that keeps state between steps)."""
        guards.check_trainers_first_batch(self, inputs, target)

    # ----------------------------------------------------------------------- checkpoints
    def stateful(self) -> dict[str, Any]:
        """What a checkpoint holds besides the weights, by name: objects with ``state_dict()``
        and ``load_state_dict()`` (``None``: not part of this run). A subclass that keeps
        state across steps (an RNN's hidden state, a curriculum) adds its own and it is saved
        and resumed with the rest: ``return {**super().stateful(), "carry": self.carry}``."""
        loader = self._train_loader
        return {
            "loop": self.state,
            # (FSDP: the weights' and optimizer's shards, glassloop.distributed.fsdp.ShardedState)
            "optimizer": self.sharded if self.sharded is not None else self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler if self.fp16 else None,
            "ema": self.ema,
            "data": loader if hasattr(loader, "state_dict") else None,
            "micro_batches": self.micro_batches if self.micro_batches.auto else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs (a collective with several
        processes): :meth:`stateful`, the epoch's losses, callbacks, RNG, the loss-spike
        guard's window (:meth:`glassloop.checkpoint.checkpointer.Checkpointer.state_dict`)."""
        return self._attached().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the weights are the model's own to load)."""
        self._attached().load_state_dict(state)

    def save_checkpoint(self, *, finished: bool = False, best: bool = False) -> Path | None:
        """Replaced by ``trainer.checkpointer.save()``; works, with a warning, until 0.2."""
        warn_replaced("Trainer.save_checkpoint()", "trainer.checkpointer.save()")
        return self._attached().save(finished=finished, best=best)

    def _attached(self) -> Checkpointer:
        """The checkpointer, handed what a save holds (what ``fit`` does first)."""
        self.checkpointer.attach(self.stateful(), loader=self._train_loader, trainer=self)
        return self.checkpointer

    @property
    def last_grad_norm(self) -> torch.Tensor | float | None:
        """The last step's gradient norm before clipping (``clip_grad_norm``; ``None``
        without): what step rows and epoch rows report."""
        return self.state.grad_norm

    @property
    def last_eval(self) -> dict[str, Any] | None:
        """The last validation's metrics of the first set (what the report shows)."""
        return self.validator.last

    @property
    def history(self) -> History:
        """One dict per finished epoch (what ``fit`` returns; a table in a notebook)."""
        return History(self.record.history)

    def _repr_html_(self) -> str:  # (a Trainer as a notebook shows it)
        return trainer_html(self)

    # ------------------------------------------------------------------ evaluate, predict
    @property
    def eval_model(self) -> nn.Module:
        """What is evaluated and exported: the EMA of the weights when enabled, else the model."""
        return evaluated(self.model, self.ema)

    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]:
        """The loss (mean over samples) and the task's metrics (:func:`glassloop.evaluate`),
        plus ``metrics``. Override it to add your own: returned numbers become ``val_*``.
        In a multi-process FSDP job every process calls it with its shard (a loader with a
        ``len()``: shards may differ by a batch)."""
        return Evaluation(evaluation.evaluate_with(self, loader))  # (tables in a notebook)

    def predict(
        self,
        data: torch.Tensor | Iterable[Any],
        *,
        batch_size: int = 256,
        classes: int | None = None,
    ) -> Any:
        """What the task means by a prediction (softmax or sigmoid probabilities, or the
        outputs as they are; :func:`glassloop.predict`), a tensor on the CPU, under inference
        mode; with a task per head every head's, in a dict by name (a tuple for a model that
        returns one: :func:`~glassloop.evaluation.evaluate.predict_heads`; hence ``Any``).
        In a multi-process FSDP job every process calls it, each with its own data."""
        return evaluation.predict_with(self, data, batch_size, classes)


Trainer.__doc__ = (Trainer.__doc__ or "") + options.described()  # the options, one entry each
