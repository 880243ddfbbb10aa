"""The Trainer's options, one table: each field of :class:`TrainOptions` is one keyword of
``Trainer(...)`` and one key of a config's ``[train]``, with its default, its rule and whether
a resume may change it in ``option(...)``, and its description in the docstring under it
(where editors and documentation tools look). Everything else is derived from this table:
``help(Trainer)``'s argument lines (:func:`described`), the Trainer's checks and the config's
(:func:`check_options`, :func:`rules`), the ``[train]`` schema (``TrainConfig``
extends :class:`TrainOptions`), the config → Trainer mapping, what a run built in Python
records and what a resume compares (:func:`resume_safe`). A new option is written twice:
here and in the Trainer's signature (``tests/loop/test_trainer_arguments.py`` checks that they
agree).

Also here, torch-free for the same reason, the Trainer's other argument types:
:class:`CheckpointConfig`, :class:`TrackingConfig`, :class:`RunInfo`, and the early stopping
of a config (:class:`EarlyStoppingConfig`).
"""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from glassloop.rules import (
    AT_LEAST_0,
    AT_LEAST_1,
    FRACTION,
    OffOr,
    Range,
    check_choice,
    check_range,
)

Rule = Range | tuple[Any, ...]
SIGNALS = ("TERM", "INT", "USR1", "USR2")  # each a stop signal (preemption.STOP_SIGNALS)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def option(default: Any, *, rule: Rule | None = None, resume_safe: bool = False) -> Any:
    """A field of :class:`TrainOptions`: its default (a list: a fresh copy per instance), the
    values it accepts (``rule``: a :class:`~glassloop.rules.Range` or the choices) and
    whether a resumed run may change it without changing what it computes."""
    meta = {"rule": rule, "resume_safe": resume_safe}
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainOptions:
    """The Trainer's options (``Trainer(..., name=value)``; ``[train] name = value``)."""

    # ----------------------------------------------------- the model, its loss and what it is for
    task: str = option("auto")
    """"auto" (from the loss), "classification", "multilabel", "regression", "language-model"
    or "custom": what ``predict`` returns and which metrics are reported
    (:mod:`glassloop.tasks`); a model with several heads: a task each (``{'kind':
    'classification', 'size': 'regression'}``, in Python: every head predicted, its metrics as
    ``val_<head>_<metric>``)."""
    outputs: str = option("auto", rule=("auto", "logits", "probabilities"))
    """"auto", "logits" or "probabilities": what the model returns; probabilities (auto: with
    BCELoss or a final ``nn.Sigmoid``/``nn.Softmax``) are never put through a second sigmoid or
    softmax by ``predict``, and a label is decided at 0.5."""
    metrics: list[str] = option([])
    """more metrics, by name (``['top5_accuracy']``) or, in Python, ``{name: metric}``."""
    train_accuracy: bool = option(False)
    """also count how many training labels each step's outputs get right, on the device as
    they train (an argmax per batch: off by default, a few percent of a tiny model's step):
    the bar's running ``acc`` and the epoch's ``train_accuracy``; a classifier's (one label
    per row or per token) trained with a loss function. Counted in a step's first
    ``forward_backward`` (LBFGS's first evaluation); batches whose targets are not class
    labels (soft targets) are not counted."""

    # -------------------------------------------------------------------------------- the step
    precision: str = option("32", rule=("32", "bf16", "fp16"))
    """"32", "bf16" (autocast) or "fp16" (autocast and a GradScaler)."""
    grad_accum_steps: int = option(1, rule=AT_LEAST_1)
    """micro-batches per optimizer step, weighted by ``loss_weighting`` so that a step is one
    big batch."""
    micro_batch_size: int | str = option(0, rule=AT_LEAST_0)
    """split each batch into micro-batches of at most this many rows, weighted so that the step
    is the whole batch's (0: off); "auto": halved on an out-of-memory error in the first steps,
    the plan printed and kept for a resume (:mod:`glassloop.step.micro_batches`)."""
    loss_weighting: str = option("samples", rule=("samples", "tokens"))
    """"samples", or "tokens" (labels other than ``ignore_index``)."""
    loss_reduction: str = option("auto", rule=("auto", "mean", "sum"))
    """"auto" (the loss module's), "mean" or "sum" (reported per sample)."""
    ignore_index: int = option(-100)
    """the label a token loss skips (-100, as ``CrossEntropyLoss``)."""
    clip_grad_norm: float = option(0.0, rule=AT_LEAST_0)
    """clip the gradients' total norm to this (0: off); the norm before clipping is reported
    as ``grad_norm``."""
    clip_grad_value: float = option(0.0, rule=AT_LEAST_0)
    """clip each gradient element to ``[-value, value]`` (0: off)."""
    nonfinite: str = option("raise", rule=("raise", "strict", "skip"))
    """on a NaN/inf loss or gradient: "raise" (seen on the device, read where the loop reads
    anyway, stops naming the first bad step, nothing saved after it), "strict" (checked before
    every step), "skip" (dropped; ``[train] max_nonfinite_skips`` in a row at most), or in
    Python a :class:`~glassloop.step.guards.NonFinitePolicy`."""
    loss_spike: float = option(0.0, rule=OffOr(1, open_low=True))
    """also stop at a finite loss over this many times the median of the 20 steps before,
    naming its step and batches (0: off)."""
    ema_decay: float = option(0.0, rule=FRACTION)
    """a moving average of the weights with this decay (e.g. 0.999; 0: off), evaluated and
    exported instead."""
    compile: bool = option(False, resume_safe=True)
    """``torch.compile`` the model (``[train] compile_mode``, ``compile_dynamic``; in Python
    ``{'mode': ..., 'dynamic': ...}``); checkpoints load with or without it."""
    activation_checkpointing: list[str] = option([])
    """module class names whose activations are recomputed in backward instead of kept: less
    memory, bitwise the same weights
    (:func:`~glassloop.step.parallelize.checkpoint_activations`)."""

    # ------------------------------------------------------------------------------- the epoch
    validate_every_n_steps: int = option(0, rule=AT_LEAST_0)
    """also validate inside epochs (``"kind": "val"`` rows; 0: at epoch ends only)."""
    limit_batches: int = option(0, rule=AT_LEAST_0)
    """at most this many training and validation batches per epoch (0: all; a quick run
    through everything)."""
    seed: int | None = option(None, rule=Range(0, 2**63 - 1))
    """seeds python/numpy/torch (a config: before the model is built; the Trainer: here, after
    it was built; call :func:`glassloop.seed_everything` before building it for reproducible
    initial weights)."""
    deterministic: bool | str = option(False, rule=(False, True, "warn"))
    """``True``: torch's deterministic algorithms (and cuDNN's, cuBLAS's workspace); "warn":
    only warn where an operation has none (process-wide; recorded in run.json)."""

    # --------------------------------------------------------------------------- where it runs
    device: str = option("auto", resume_safe=True)
    """"auto" (CUDA, MPS, CPU) or a device."""
    strategy: str = option("auto", rule=("auto", "ddp", "fsdp", "dp"))
    """several processes (torchrun): "auto"/"ddp" (DDP), or "fsdp" (FSDP2)."""

    # ---------------------------------------------------------------------- the run directory
    tensorboard: bool = option(False)
    """also write TensorBoard event files (``RUN_DIR/tensorboard/``, glassloop[tensorboard])."""
    progress: str = option("auto", rule=("auto", "bar", "lines", "none"), resume_safe=True)
    """"auto", "bar", "lines" or "none"."""
    log_every: int = option(100, rule=AT_LEAST_1, resume_safe=True)
    """a step row (and the tutorial's loss line) every this many steps."""
    stop_signals: list[str] = option(list(SIGNALS), rule=SIGNALS, resume_safe=True)
    """the signals that stop the run after the current step with a checkpoint (a second one
    aborts at once): "TERM", "INT", "USR1", "USR2", all by default (SIGUSR1 is Slurm's early
    warning, ``--signal=USR1@90``; its default action would end the run unsaved)."""
    grace_s: float = option(0.0, rule=AT_LEAST_0, resume_safe=True)
    """the seconds a scheduler leaves between its stop signal and SIGKILL (Slurm's
    ``--signal=USR1@N``, Kubernetes' ``terminationGracePeriodSeconds``; 0: not declared):
    the first save's time is said against it, with a warning when a checkpoint takes longer."""
    profile: int = option(0, rule=AT_LEAST_0, resume_safe=True)
    """a ``torch.profiler`` trace of this many steps into ``RUN_DIR/profile/``, and the top
    operators printed (0: none; :mod:`glassloop.step.profiling`)."""


@dataclass
class TrainConfig(TrainOptions):
    """A config's ``[train]``: the Trainer's options and the keys ``build()`` reads itself."""

    epochs: int = option(10, rule=AT_LEAST_1, resume_safe=True)
    """epochs to train (``fit(epochs=)``)."""
    seed: int = option(0, rule=Range(0, 2**63 - 1))
    """seeds python/numpy/torch before the data and the model are built."""
    max_nonfinite_skips: int = option(10, rule=AT_LEAST_1)
    """``nonfinite = "skip"``: stop after this many skipped steps in a row."""
    compile_mode: str = option("default", rule=COMPILE_MODES, resume_safe=True)
    """``torch.compile``'s mode: "default", "reduce-overhead", "max-autotune", ..."""
    compile_dynamic: bool = option(False, resume_safe=True)
    """False: static shapes (a resumed run compiles the same)."""
    dist_timeout_s: float = option(300.0, rule=Range(0, open_low=True))
    """A collective waiting longer (a dead process) fails the job."""


OPTIONS = frozenset(f.name for f in fields(TrainOptions))  # the Trainer's keywords among them
# The scheduler's own option: [scheduler] interval, the Trainer's scheduler_interval.
SCHEDULER_INTERVALS = ("epoch", "step")


def resume_safe(cls: type) -> list[str]:
    """The fields of ``cls`` a resumed run may change: they change how it runs, not what it
    computes."""
    return [f.name for f in fields(cls) if f.metadata.get("resume_safe")]


def rules(cls: type = TrainOptions) -> dict[str, Rule]:
    """The rule of each field of ``cls`` that has one (declared with :func:`option`)."""
    return {f.name: f.metadata["rule"] for f in fields(cls) if f.metadata.get("rule") is not None}


def check_options(values: dict[str, Any], *, where: str = "Trainer") -> None:
    """Check each of ``values`` that is an option (by name; the scheduler's interval too)
    against its rule; a value of another kind than the rule's (a Python object where a
    config takes a name, ``None``) is left to the part that takes it.

    >>> check_options({"log_every": 0, "model": object()})
    Traceback (most recent call last):
    ...
    glassloop.errors.ConfigError: Trainer: log_every must be >= 1, got 0
    """
    table = {**rules(TrainConfig), "scheduler_interval": SCHEDULER_INTERVALS}
    for name, value in values.items():
        rule = table.get(name)
        if isinstance(rule, Range) and isinstance(value, (int, float)):
            check_range(name, value, rule, where=where)
        elif isinstance(rule, tuple) and isinstance(value, (str, bool, list, tuple)):
            check_choice(name, value, rule, where=where)


def docs(cls: type = TrainOptions) -> dict[str, str]:
    """Each field's description (the string under it in the source), by name, in order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    found: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            found[node.target.id] = " ".join(str(after.value.value).split())
    return found


# The Trainer's arguments that are objects, not options: what each is.
ARGUMENTS = {
    "model": "any ``nn.Module``; its outputs (a tensor, a tuple, a dict, a Hugging Face "
    "output) go to ``loss_fn``.",
    "optimizer": "a ``torch.optim`` optimizer, or several by name (a GAN's ``{'g': ..., 'd': "
    "...}``: :class:`~glassloop.step.optim.Optimizers`, stepped in turn); one whose "
    "``step`` takes a closure (LBFGS) gets one.",
    "loss_fn": "``loss_fn(output, target)``; ``None``: the model's own (it gets the target as "
    "``labels=``, as Hugging Face models do).",
    "scheduler": "an LR scheduler (or several by name); ``ReduceLROnPlateau`` steps on val_loss.",
    "scheduler_interval": 'it steps every "epoch" or every "step" (``[scheduler] interval``).',
    "callbacks": "hooks around the loop (:mod:`glassloop.callbacks`).",
    "world": "the job's processes (default: torchrun's environment).",
    "run_dir": "where checkpoints, metrics and the report go (``None``: nothing written).",
    "checkpoint": "when to save, how many to keep, what picks ``best/`` "
    "(:class:`CheckpointConfig`, ``[checkpoint]``).",
    "run_info": "the config a resume compares and the model spec that rebuilds the model from "
    "its weights (:class:`RunInfo`).",
    "tracking": "MLflow or W&B (:class:`TrackingConfig`, ``[tracking]``).",
}


def described() -> str:
    """The arguments section of ``help(Trainer)``: the objects it is given
    (:data:`ARGUMENTS`), then every option of :class:`TrainOptions` with its default and
    its description."""
    defaults = TrainOptions()
    entries = [f"``{name}``: {text}" for name, text in ARGUMENTS.items()]
    lines = ["", "    Arguments:", "", *_wrapped(entries), ""]
    lines += ["    Options (in a config: the ``[train]`` key of the same name):", ""]
    options = docs().items()
    lines += _wrapped(f"``{n}`` (default {getattr(defaults, n)!r}): {t}" for n, t in options)
    return "\n".join(lines) + "\n"


def _wrapped(entries: Iterable[str]) -> list[str]:
    return [
        textwrap.fill(e, 92, initial_indent=" " * 6, subsequent_indent=" " * 8) for e in entries
    ]


@dataclass
class CheckpointConfig:
    """When to save (``every_n_steps``, ``every_n_epochs``; always at the end), how many to
    keep, and which validation metric picks ``RUN_DIR/best/`` (``""``: no best tracking)."""

    every_n_steps: int = option(0, rule=AT_LEAST_0)
    """save every this many optimizer steps (0: off)."""
    every_n_epochs: int = option(1, rule=AT_LEAST_0)
    """save at the end of every this many epochs (0: off)."""
    keep_last: int = option(3, rule=AT_LEAST_0)
    """keep the newest this many checkpoints, removing older ones (0: keep all)."""
    monitor: str = ""
    """the metric that picks ``RUN_DIR/best/``: "val_loss", "val_accuracy", ... ("": none)."""
    mode: str = option("auto", rule=("auto", "min", "max"))
    """"min" or "max": ``monitor`` improves by falling or rising ("auto": max for accuracy/F1)."""
    async_save: bool = False
    """true: the weights and the optimizer's state are copied to host memory while the next
    step's forward and backward run (its optimizer step waits for the copy); the write goes
    on in the background, one save at a time (:mod:`glassloop.checkpoint.background`)."""
    save_frozen: bool = False
    """a model with frozen parameters (a peft adapter's base, a frozen encoder): false, its
    checkpoints hold the trainable tensors and the SHA-256 of the frozen ones, which a resume
    checks against the model it builds (:mod:`glassloop.storage.frozen_base`); true: every
    tensor."""
    final_weights: str = option("auto", rule=("auto", "full", "trainable"))
    """``RUN_DIR/model.safetensors``: "auto" (a peft model's adapter alone, any other model
    whole), "full" or "trainable" (without the frozen base, whose SHA-256 it records)."""


@dataclass
class TrackingConfig:
    """Where a run is tracked (``[tracking]`` in a config; ``backend = ""``: nowhere)."""

    backend: str = option("", rule=("", "mlflow", "wandb"))
    """"" (off), "mlflow" or "wandb"."""
    uri: str = ""
    """MLflow: the tracking URI ("": ``sqlite:///mlflow.db`` here); W&B: the server."""
    experiment: str = "glassloop"
    """the MLflow experiment, the W&B project."""
    run_name: str = ""
    """the tracked run's name ("": the run directory's name)."""
    tags: dict[str, Any] = field(default_factory=dict)
    """tags for the tracked run, e.g. ``{ team = "vision" }``."""


@dataclass
class EarlyStoppingConfig:
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs."""

    monitor: str = ""
    """the metric watched: "train_loss" or a validation metric, e.g. "val_loss" ("": off)."""
    patience: int = option(3, rule=AT_LEAST_1)
    """epochs without improvement before the run stops."""
    min_delta: float = option(0.0, rule=AT_LEAST_0)
    """the least change that counts as an improvement."""
    mode: str = option("auto", rule=("auto", "min", "max"))
    """"min" or "max": ``monitor`` improves by falling or rising ("auto": max for accuracy)."""


@dataclass
class RunInfo:
    """What a run records about itself in run.json and every checkpoint's meta.json: its
    ``config`` (compared on resume; ``None``: the Trainer's own arguments are recorded), the
    ``model_spec`` that rebuilds the model from its weights file alone
    (:func:`glassloop.load_model`), and the versions that ran it (filled in by ``fit``)."""

    config: dict[str, Any] | None = None
    model_spec: dict[str, Any] | None = None
    versions: dict[str, Any] = field(default_factory=dict)
