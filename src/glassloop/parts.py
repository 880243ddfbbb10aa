"""The Trainer's parts: its arguments checked and each handed to the component whose job it
is, and the methods around the loop — what a checkpoint holds (``stateful``, ``state_dict``,
``save_checkpoint``, resuming), ``evaluate`` and ``predict``, the first-batch guard.

:class:`TrainerParts` is the base of :class:`glassloop.loop.Trainer`, which holds the loop
itself (Keras 3 splits its ``Trainer`` the same way: the set-up and the API around ``fit`` in
one class, the loop in the class built on it). Nothing here runs a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import glassloop.evaluation as evaluation
import glassloop.guards as guards
import glassloop.optimizers as optimizers
import glassloop.tasks as tasks
from glassloop.batch import Inputs
from glassloop.callbacks import Callback
from glassloop.checkpointer import (
    CheckpointConfig,
    Checkpointer,
    restore_state,
    resumed_messages,
    state_of,
)
from glassloop.device import resolve_device
from glassloop.distributed import World, init_from_env, local_device, unwrap_model
from glassloop.evaluation import LossFn, Metric
from glassloop.guards import NonFinitePolicy, NonFiniteWatch
from glassloop.optimizers import Schedulers
from glassloop.parallelize import averaged, evaluated, prepare_model
from glassloop.precision import autocast, check_precision, make_scaler
from glassloop.preemption import StopSignals
from glassloop.profiling import StepProfiler
from glassloop.redaction import redacted
from glassloop.replaced import fold_replaced
from glassloop.rng import seed_everything, use_deterministic
from glassloop.run_log import RunInfo, RunLog
from glassloop.sinks import ProgressReporter
from glassloop.state import EpochRecord, TrainState
from glassloop.tracking import TrackingConfig
from glassloop.validation import check_trainer_options
from glassloop.validator import Validator


class TrainerParts:
    """A :class:`~glassloop.loop.Trainer` before and around its loop (see there): the
    constructor, checkpoint state, evaluation and prediction. Every argument is described
    in ``help(Trainer)`` (:mod:`glassloop.arguments`)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | Mapping[str, Any],
        loss_fn: LossFn | None, *,
        # the model, its loss and what it is for
        task: str | Mapping[str, str] = "auto", outputs: str = "auto",
        metrics: Sequence[str] | Mapping[str, Metric | str] | None = None,
        # the step
        precision: str = "32", grad_accum_steps: int = 1, loss_weighting: str = "samples",
        loss_reduction: str = "auto", ignore_index: int = -100,
        clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
        nonfinite: str | NonFinitePolicy = "raise", loss_spike: float = 0.0,
        ema_decay: float | None = None,
        compile: bool | Mapping[str, Any] = False, activation_checkpointing: Sequence[str] = (),
        scheduler: Any = None, scheduler_interval: str = "epoch",  # (or a dict of them)
        # the epoch
        validate_every_n_steps: int = 0, limit_batches: int = 0, seed: int | None = None,
        deterministic: bool | str = False, callbacks: Sequence[Callback] = (),
        # where it runs
        device: str | torch.device = "auto", world: World | None = None, strategy: str = "auto",
        # the run directory
        run_dir: str | Path | None = None, checkpoint: CheckpointConfig | None = None,
        run_info: RunInfo | None = None, tensorboard: bool = False,
        tracking: TrackingConfig | None = None, progress: str = "auto", log_every: int = 100,
        profile: int = 0,
        **replaced: Any,  # names replaced in 0.2 (glassloop.replaced), with a warning
    ) -> None:  # fmt: skip
        policy, compiled, run_info = fold_replaced(replaced, nonfinite, compile, run_info)
        guards.check_model(model)  # its own train()/eval() in place of nn.Module's, no weights
        optimizer = optimizers.one_optimizer(optimizer)  # several by name (a GAN's): one
        scheduler = Schedulers(scheduler) if isinstance(scheduler, Mapping) else scheduler
        check_trainer_options({  # the rules the config reader applies too, one table
            "scheduler_interval": scheduler_interval, "loss_weighting": loss_weighting,
            "log_every": log_every, "grad_accum_steps": grad_accum_steps, "ema_decay": ema_decay,
            "clip_grad_norm": clip_grad_norm, "clip_grad_value": clip_grad_value,
            "max_nonfinite_skips": policy.max_skips, "precision": precision,
            "loss_spike": loss_spike,
            "validate_every_n_steps": validate_every_n_steps, "limit_batches": limit_batches,
        })  # fmt: skip
        # What the model is trained to do (glassloop.tasks): decides what predict returns,
        # the metrics and the checks; loss_fn=None: the model computes its own loss.
        # A model with several heads: a task each ({"kind": "classification", ...}).
        task, self.heads = tasks.resolve_heads(task)
        self.task = tasks.resolve_task(task, loss_fn)
        # (BCELoss, a final nn.Sigmoid: probabilities already, never through a second one)
        self.probabilities = tasks.outputs_are_probabilities(outputs, model, loss_fn)
        # "sum": the loss adds up over a batch (reported per sample; micro-batches add up)
        self.loss_reduction = tasks.reduction_of(loss_fn, loss_reduction)
        self.summed = self.loss_reduction == "sum"  # (read every step: an attribute)
        self.metrics = evaluation.metric_table(metrics, self.task, self.heads)
        self.validate_every_n_steps = validate_every_n_steps
        self.limit_batches = limit_batches
        if seed is not None:
            seed_everything(seed)
        self.deterministic = use_deterministic(deterministic)  # "on", "warn" or "off"
        # Several processes (torchrun): join their process group (a no-op in one process),
        # this process's rank, and its own device.
        resolved = resolve_device(device)
        self.world = world if world is not None else init_from_env(resolved, strategy=strategy)
        self.device = local_device(resolved, self.world)
        self.distributed = self.world.distributed  # (read every step: an attribute)
        self.precision_note = check_precision(precision, self.device)
        # Compiled, then under DDP or FSDP2 with several processes (glassloop.parallelize);
        # sharded: an FSDP run's weights and optimizer state, which checkpoints save.
        self.model, self.sharded = prepare_model(
            model, optimizer, self.world, self.device, strategy=strategy, precision=precision,
            compile=compiled, ema=bool(ema_decay), checkpointed=activation_checkpointing,
        )  # fmt: skip
        self._parameters = list(self.model.parameters())
        optimizers.check_kernels(optimizer)  # on the device: capturable=True needs a GPU
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.precision = precision
        self.scaler = make_scaler(precision, self.device)
        self.grad_accum_steps = grad_accum_steps
        self.loss_weighting = loss_weighting
        self.ignore_index = ignore_index
        self.clip_grad_norm = clip_grad_norm or None
        self.clip_grad_value = clip_grad_value or None
        self.nonfinite = policy
        # LBFGS & co.: step(closure) evaluates forward, loss and backward itself.
        self.closure_step = optimizers.closure_step(
            optimizer, precision=precision, clipping=bool(clip_grad_norm or clip_grad_value),
            nonfinite=policy.policy, processes=self.world.size,
        )  # fmt: skip
        # The default: NaN/inf noticed on the device, read where the loop reads anyway (no
        # host sync per step); "strict", "skip" and fp16 (its scaler reads) check each step.
        self.watch = NonFiniteWatch(spike=loss_spike)  # (and finite spikes, when asked)
        self.deferred_check = policy.policy == "raise" and not self.scaler.is_enabled()
        # An exponential moving average of the weights (torch's AveragedModel): evaluated
        # and exported instead of the raw weights when enabled.
        self.ema_decay = ema_decay or None
        self.ema = averaged(self.model, ema_decay) if ema_decay else None
        self.log_every = log_every
        self.profile = profile  # steps to profile (0: none): glassloop.profiling
        self.profiler: StepProfiler | None = None
        self.callbacks = list(callbacks)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.checkpointer = Checkpointer(self.run_dir, checkpoint, world=self.world)
        self.run_log = RunLog(
            self.run_dir, world=self.world, tensorboard=tensorboard, tracking=tracking
        )
        # What the run records and compares on resume (secrets in URIs replaced by ***).
        info = run_info or RunInfo()
        self.config = redacted(dict(info.config)) if info.config is not None else None
        self.model_spec = dict(info.model_spec) if info.model_spec is not None else None
        self.info = RunInfo(self.config, self.model_spec)  # (and fit's versions)
        # Only rank 0 talks: the other processes print nothing at all.
        self.console = ProgressReporter(progress, silent=not self.world.is_main)
        self.state = TrainState()
        self.record = EpochRecord()
        self.last_grad_norm: torch.Tensor | None = None
        self.should_stop = False  # callbacks set it to end the run after this epoch
        self._signals = StopSignals()
        self._train_loader: Iterable[Any] = ()
        self.validator = Validator(None)  # fit's validation sets (glassloop.validator)
        self._checked_first_batch = False
        self._label_shift: int | None = None  # tokens a model's own loss counts: from t+shift
        self._failure: str | None = None  # the error a failed fit ended with, for run.json

    # ---------------------------------------------------------------- hooks of the step
    def check_first_batch(self, inputs: Inputs, target: Any) -> None:
        """The first-batch guard (:func:`glassloop.guards.check_first_batch`): NaN/inf
        inputs, labels within the model's outputs. Override it to replace it, or with
        ``pass`` to switch it off (e.g. for a model that keeps state between steps)."""
        guards.check_first_batch(
            unwrap_model(self.model), inputs, target, precision=self.precision,
            device=self.device, ignore_index=self.ignore_index, task=self.task,
            own_loss=self.loss_fn is None,
        )  # fmt: skip

    # ------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, *, finished: bool = False, best: bool = False) -> Path | None:
        """Commit a checkpoint of the current step under ``run_dir`` (None without one);
        ``best``: ``RUN_DIR/best/`` instead."""
        self.watch.check(self.state, self.world)  # never a checkpoint after a NaN step
        if self.run_dir is None:
            return None
        state = self.state_dict()  # collective (RNG of every process): all processes call it
        self.run_log.check_exists()
        meta = self.checkpointer.meta(self.state, self.history, self.info, finished=finished)
        save = self.checkpointer.save_best if best else self.checkpointer.save
        return save(self.model, state, meta, self.sharded)

    def stateful(self) -> dict[str, Any]:
        """What a checkpoint holds besides the weights, by name: objects with ``state_dict()``
        and ``load_state_dict()`` (``None``: not part of this run). A subclass that keeps
        state across steps (an RNN's hidden state, a curriculum) adds its own and it is saved
        and resumed with the rest: ``return {**super().stateful(), "carry": self.carry}``."""
        loader = self._train_loader
        return {
            "loop": self.state,
            # (FSDP: the weights' and the optimizer's shards, see glassloop.fsdp.ShardedState)
            "optimizer": self.sharded if self.sharded is not None else self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler if self.scaler.is_enabled() else None,
            "ema": self.ema,
            "data": loader if hasattr(loader, "state_dict") else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything but the weights that an exact resume needs (:func:`~glassloop.
        checkpointer.state_of`: :meth:`stateful`, the epoch's losses, callbacks, RNG, the
        loss-spike guard's window)."""
        parts, loader = self.stateful(), self._train_loader
        return state_of(parts, self.record, self.callbacks, loader, self.world, self.watch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the global RNGs last, right before training goes on."""
        parts, loader, world = self.stateful(), self._train_loader, self.world
        restore_state(state, parts, self.record, self.callbacks, loader, world, self.device,
                      self.watch)  # fmt: skip

    def _start_from(self, resume: str | Path | None, allow_change: bool, epochs: int) -> None:
        """Resume from a checkpoint (``resume``: ``"auto"`` or a path; what :meth:`fit` says),
        and say where it goes on; without ``resume``, make sure a fresh run overwrites none."""
        if resume is None:
            self.checkpointer.refuse_overwrite()
            return
        checkpoint = self.checkpointer.restore(
            resume, self.model, self.load_state_dict, config=self.info.config,
            allow_config_change=allow_change, warn=self.console.message,
            shards=self.sharded,
        )  # fmt: skip
        if checkpoint is not None and self.state.epoch < epochs and not self.state.stopped:
            for line in resumed_messages(checkpoint, self.state, self._train_loader):
                self.console.message(line)

    @property
    def last_eval(self) -> dict[str, Any] | None:
        """The last validation's metrics of the first set (what the report shows)."""
        return self.validator.last

    @property
    def history(self) -> list[dict[str, Any]]:
        """One dict per finished epoch (what ``fit`` returns)."""
        return self.record.history

    # ------------------------------------------------------------------------ eval / predict
    @property
    def eval_model(self) -> nn.Module:
        """What is evaluated and exported: the EMA of the weights when enabled, else the model."""
        return evaluated(self.model, self.ema)

    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]:
        """The loss (mean over samples) and the task's metrics (:func:`glassloop.evaluate`),
        plus ``metrics``. Override it to add your own: returned numbers become ``val_*``.
        In a multi-process FSDP job every process calls it with its shard (a loader with a
        ``len()``: shards may differ by a batch)."""
        with autocast(self.precision, self.device):
            return evaluation.evaluate(
                self.eval_model, self.console.validation(loader), self.loss_fn,
                task=self.task, device=self.device, loss_reduction=self.loss_reduction,
                ignore_index=self.ignore_index, metrics=self.metrics, heads=self.heads,
                outputs="probabilities" if self.probabilities else "logits",
            )  # fmt: skip

    def predict(
        self, data: torch.Tensor | Iterable[Any], *, batch_size: int = 256,
        classes: int | None = None,
    ) -> Any:  # fmt: skip
        """What the task means by a prediction (softmax or sigmoid probabilities, or the
        outputs as they are; :func:`glassloop.predict`), a tensor on the CPU, under inference
        mode; with a task per head every head's, in a dict by name (a tuple for a model that
        returns one: :func:`~glassloop.evaluation.predict_heads`; hence ``Any``).
        In a multi-process FSDP job every process calls it, each with its own data."""
        with autocast(self.precision, self.device):
            if self.heads:
                model, size, device = self.eval_model, batch_size, self.device
                return evaluation.predict_heads(
                    model, data, self.heads, batch_size=size, device=device
                )
            return evaluation.predict(  # (a loss of the user's says nothing: as they are)
                self.eval_model, data,
                task=tasks.predicted_task(self.task, self.loss_fn, self.last_eval),
                batch_size=batch_size,
                device=self.device, classes=classes, probabilities=self.probabilities,
            )  # fmt: skip
