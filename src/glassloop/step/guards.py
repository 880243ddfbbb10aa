"""The loop's guards: cheap checks on the first batch and on the parts a Trainer is given,
torch errors caused by the user's data, model or optimizer turned into one clear line naming
that culprit, and the non-finite policy (raise, or skip and count).

A Trainer subclass replaces the first-batch guard by overriding
``Trainer.check_first_batch`` (for example a stateful model that must not be called outside
its step), or switches it off with an override that does nothing.
"""

from __future__ import annotations

import inspect
import math
import os
import statistics
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from glassloop.batch import Inputs, describe_batch
from glassloop.distributed.fsdp import local
from glassloop.distributed.world import World, all_reduce, unwrap_model
from glassloop.errors import ConfigError, DataError, GlassloopError, ModelError, NonFiniteError
from glassloop.precision import autocast
from glassloop.rules import AT_LEAST_1, check_range
from glassloop.state import TrainState
from glassloop.step.micro_batches import MicroBatches
from glassloop.step.window import split_rows
from glassloop.tasks import LABEL_TASKS, check_same_shape, class_scores, prediction_of

SPIKE_WINDOW = 20  # the steps a loss spike is measured against (their median)


class LossSpikeError(NonFiniteError):
    """A finite loss far above the recent ones (``train.loss_spike``); exit code 4."""


class Saying(Protocol):
    def message(self, text: str) -> None: ...


class FirstBatchOf(Protocol):
    """What :func:`check_trainers_first_batch` reads of a Trainer."""

    model: nn.Module
    loss_fn: Any
    precision: str
    device: torch.device
    ignore_index: int
    task: str
    probabilities: bool
    micro_batches: MicroBatches
    state: TrainState

    @property
    def options(self) -> Mapping[str, Any]: ...
    @property
    def console(self) -> Saying: ...


def check_trainers_first_batch(trainer: FirstBatchOf, inputs: Inputs, target: Any) -> None:
    """:func:`check_first_batch` as a Trainer runs it on its first batch: the model as its
    own module; its loss's checks (a cross-entropy: no softmax before it); the rows that fit
    (``micro_batch_size``); the warnings of a fresh run only; outputs read as logits when
    ``outputs="auto"`` decided so."""
    micro, loss_fn = trainer.micro_batches, trainer.loss_fn
    check_first_batch(
        unwrap_model(trainer.model),
        inputs,
        target,
        precision=trainer.precision,
        device=trainer.device,
        ignore_index=trainer.ignore_index,
        task=trainer.task,
        own_loss=loss_fn is None,
        cross_entropy=isinstance(loss_fn, nn.CrossEntropyLoss),
        rows=micro.rows or (1 if micro.auto else None),
        say=None if trainer.state.step else trainer.console.message,
        read_as_logits=trainer.options["outputs"] == "auto" and not trainer.probabilities,
    )


def check_first_batch(
    model: nn.Module,
    inputs: Inputs,
    target: Any,
    *,
    precision: str = "32",
    device: torch.device | None = None,
    ignore_index: int = -100,
    task: str = "classification",
    own_loss: bool = False,
    cross_entropy: bool = False,
    rows: int | None = None,
    say: Callable[[str], None] | None = None,
    read_as_logits: bool = False,
) -> None:
    """Inputs free of NaN/inf; integer class labels within the model's outputs; a
    regression's outputs and targets of one shape (torch would broadcast them silently);
    under ``cross_entropy`` (an ``nn.CrossEntropyLoss``), no softmax already applied.
    ``rows``: the forward sees the first rows only (``micro_batch_size``: what fits); every
    label is still checked. ``say``: where a warning goes (a fresh run's: under
    ``cross_entropy``, a first loss far above ln(C), what an untrained classifier gives;
    ``read_as_logits``, outputs taken for logits by ``outputs="auto"`` that look like a
    sigmoid's or a softmax's, written as a function in ``forward``).

    The outputs come from an eval-mode, no-grad forward of ``model`` (pass the unwrapped
    module): no dropout, no batch-norm update, no RNG draw, so training is not changed by it.
    """
    args, kwargs = inputs
    for name, value in [*enumerate(args), *kwargs.items()]:
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        if floating and not _finite_values(value):
            raise DataError(
                f"data: the first training batch has NaN or inf in input {name!r}; "
                "clean or impute the data before training"
            )
    if not isinstance(target, torch.Tensor) or task == "custom":
        return  # nothing about the outputs to check
    if task == "multilabel" and not (read_as_logits and say is not None):
        return
    if task in LABEL_TASKS and target.is_floating_point():
        return  # soft targets (probabilities)
    every = target
    if rows is not None:  # the forward on what fits; the labels all checked below
        (args, kwargs), target = split_rows(((args, kwargs), target), rows)[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(precision, device or torch.device("cpu")):
            prediction = prediction_of(model(*args, **kwargs), with_loss=own_loss)
    finally:
        model.train(was_training)
    if task == "regression":
        check_same_shape(prediction, target, "the first training batch")
        return
    if task == "multilabel":
        if say is not None and _in_unit_interval(prediction.float()):
            say(_looks_activated("a sigmoid's", "the sigmoid"))
        return
    labels = class_scores(prediction, target)
    if labels is None:
        return
    classes = int(labels[0].shape[-1])
    if read_as_logits and not cross_entropy and say and _softmaxed(labels[0].float()):
        say(_looks_activated("a softmax's (each row summing to 1)", "the softmax"))
    if cross_entropy and _softmaxed(labels[0].float()):
        raise ModelError(
            "model: its outputs on the first training batch are probabilities (each row in "
            "[0, 1], summing to 1): a softmax before nn.CrossEntropyLoss, which applies "
            "log-softmax itself, trains on flattened scores; return the logits (remove the "
            "last softmax; predict applies it)"
        )
    kept = every[every != ignore_index]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= classes):
        raise DataError(
            f"data: labels in the first training batch range over [{int(kept.min())}, "
            f"{int(kept.max())}] but the model has {classes} outputs; labels must be "
            f"class indices in [0, {classes}) (or {ignore_index} to ignore)"
        )
    if say is not None and cross_entropy and classes > 1:
        scores, wanted = labels[0].float(), labels[1]
        loss = float(nn.functional.cross_entropy(scores, wanted, ignore_index=ignore_index))
        if loss > 2 * math.log(classes):  # (a pretrained model's is lower: never said)
            say(
                f"warning: the first batch's loss is {loss:.3f}, over twice the "
                f"ln({classes}) = {math.log(classes):.3f} of an untrained classifier: large "
                "initial weights, a biased last layer or unscaled inputs "
                "(glassloop.doctor(trainer, loader) checks more)"
            )


def _looks_activated(shape: str, activation: str) -> str:
    """The warning for outputs read as logits that look like probabilities already (a
    ``torch.sigmoid``/``softmax`` call in ``forward``, which ``outputs="auto"`` cannot see):
    the accuracy would be decided on them as scores and ``predict`` would apply the
    activation a second time."""
    return (
        f"warning: the model's outputs on the first training batch look like {shape}, all "
        "in [0, 1], but are read as logits (outputs='auto' sees no final nn.Sigmoid or "
        f"nn.Softmax module, and the loss does not take probabilities): accuracy and predict "
        f"would apply {activation} again; if forward returns probabilities, set "
        "outputs='probabilities' (train.outputs in a config), else return the logits"
    )


def _in_unit_interval(scores: torch.Tensor) -> bool:
    """Whether every score lies in [0, 1] (and not all at one value: a constant output says
    nothing)."""
    if scores.numel() < 2 or not bool(scores.isfinite().all()):
        return False
    low, high = float(scores.min()), float(scores.max())
    return low >= 0.0 and high <= 1.0 and low < high


def _softmaxed(scores: torch.Tensor) -> bool:
    """Whether class scores are a softmax's output: every row in [0, 1] and summing to 1 (a
    log-softmax before CrossEntropyLoss changes nothing: log-softmax of log-probabilities is
    themselves)."""
    sums = scores.sum(dim=-1)
    inside = bool(((scores >= 0) & (scores <= 1)).all())
    return inside and bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-3))


def check_batches(batches: int) -> None:
    """An epoch that trained on no batch is the data's mistake, said in one line."""
    if batches == 0:
        raise DataError(
            "data: the training loader yielded no batches (an empty dataset, or "
            "batch_size larger than the dataset with drop_last=True)"
        )


def _finite_values(tensor: torch.Tensor) -> bool:
    """Whether the values ``tensor`` stores are finite: a sparse tensor's stored values
    (``torch.isfinite`` has no sparse kernel; the pytorch/examples GCN feeds a sparse
    adjacency), and ``True`` for a layout torch cannot check: the guard's limit is never
    reported as the data's fault."""
    try:
        if tensor.layout == torch.sparse_coo:
            tensor = tensor._values()  # (uncoalesced too: no copy)
        elif tensor.layout != torch.strided:
            tensor = tensor.values()  # CSR, CSC, BSR, BSC, nested
        return bool(torch.isfinite(tensor).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def check_model(model: nn.Module) -> None:
    """Refuse, in one line, a model the loop cannot drive: its own ``train``/``eval`` in place
    of ``nn.Module``'s, in the model or in any module in it, named by its path
    (pytorch/examples' mnist_forward_forward defines ``train(self, x_pos, x_neg)`` on each
    ``Layer`` of an ``nn.ModuleList``: ``fit`` calls ``model.train()``, which calls each
    child's, evaluation ``model.eval()``), or no parameters at all (the optimizer would have
    nothing of it to step)."""
    for path, module in model.named_modules():  # (nn.Module.train calls each child's)
        name = type(module).__name__ + (f" (model.{path})" if path else "")
        for method, args in (("train", [(), (True,)]), ("eval", [()])):
            bound = getattr(module, method, None)
            if getattr(type(module), method, None) is getattr(nn.Module, method):
                continue
            try:
                for given in args:
                    inspect.signature(bound).bind(*given)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ModelError(
                    f"model: {name} defines its own {method}() (not nn.Module's "
                    f"{method}(mode=True)), which the loop calls to switch dropout and "
                    f"batch-norm; rename yours (e.g. '{method}_step') or accept nn.Module's "
                    f"signature and call super().{method}"
                ) from None
    name = type(model).__name__
    if next(iter(model.parameters()), None) is None:
        raise ModelError(
            f"model: {name} registers no parameters (no nn.Parameter, no submodule with one): "
            "there is nothing to train; register its weights as nn.Parameter or modules"
        )


def explain(err: Exception, batch: Any, state: TrainState) -> Exception:
    """A torch error as one clear line naming its culprit (``err`` itself when no culprit
    is known): the optimizer (raised in ``torch.optim``, at any step: it names the class and
    the options that differ from its defaults), the data (a label out of range; a dict
    batch's key the model does not take; the loader at the first batch) or, at the first
    batch, the model or loss. An error raised by glassloop's own code (its guards included)
    is never blamed on the user: it is ``err``."""
    if isinstance(err, GlassloopError):
        return err
    text = " ".join(str(err).split())
    where = f"epoch {state.epoch + 1}, batch {state.batch_in_epoch + 1}"
    culprit, optimizer = _culprit(err)
    if culprit == "clipping":
        return ConfigError(
            f"train: clipping the gradients (clip_grad_norm/clip_grad_value) failed at {where}: "
            f"{type(err).__name__}: {text[:200]}; torch cannot clip sparse gradients "
            "(nn.Embedding(sparse=True)): drop the clipping or use a dense layer"
        )
    if culprit == "optimizer":
        return ConfigError(
            f"optim: {type(optimizer).__name__}.step() failed at {where}: "
            f"{type(err).__name__}: {text.rstrip('.')}; {_options(optimizer)}"
        )
    if isinstance(err, AssertionError) or culprit == "glassloop":
        return err  # an invariant or glassloop's own code: a bug, with its traceback
    if isinstance(batch, Mapping) and "unexpected keyword argument" in text:  # (a TypeError)
        return DataError(
            f"data: {text.rstrip('.')}: a dict batch's keys but the target's are the model's "
            "keyword arguments; name each input key after an argument of its forward and drop "
            "the others (or make batches (inputs, target) tuples)"
        )
    if "out of bounds" in text and "arget" in text:
        return DataError(
            f"data: a label is outside the model's output range ({text}) at {where}; "
            "labels must be in [0, num_outputs)"
        )
    if state.step == 0 and culprit == "data":
        return DataError(
            f"data: reading the first training batch failed: {type(err).__name__}: {text}"
        )
    if state.step == 0:
        return ModelError(
            f"model: the first batch {describe_batch(batch)} was rejected by the model or loss: "
            f"{type(err).__name__}: {text}"
        )
    return err


_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep  # glassloop's package folder
_OPTIM = os.sep + os.path.join("torch", "optim") + os.sep
_DATA = (os.sep + os.path.join("torch", "utils", "data") + os.sep, _OWN + "data" + os.sep)


def _culprit(err: BaseException) -> tuple[str, Any]:
    """Who raised ``err``, from the files of its traceback: ``"optimizer"`` (a frame in
    ``torch.optim``, with the optimizer it stepped), ``"clipping"`` (torch's), ``"data"`` (a
    loader's frame), ``"user"`` (the innermost frame outside glassloop: the model, the loss,
    torch.nn, autograd; the built-in models count as the user's choice) or ``"glassloop"``
    (the innermost frame is glassloop's own: its code, or a torch function it called
    directly, failed)."""
    frames = [frame for frame, _ in traceback.walk_tb(err.__traceback__)]
    if not frames:
        return "user", None
    files = [os.path.abspath(frame.f_code.co_filename) for frame in frames]
    innermost = files[-1]
    owners = [frame.f_locals.get("self") for frame in frames if _OPTIM in frame.f_code.co_filename]
    stepped = [owner for owner in owners if isinstance(owner, torch.optim.Optimizer)]
    if _OPTIM in innermost and stepped:  # (the innermost is the one that failed)
        return "optimizer", stepped[-1]
    if innermost.endswith(os.path.join("torch", "nn", "utils", "clip_grad.py")):
        return "clipping", None
    if any(name.startswith(_DATA[1]) or _DATA[0] in name for name in files):
        return "data", None
    if innermost.startswith(_OWN) and innermost != _OWN + "models.py":
        return "glassloop", None
    return "user", None


def _options(optimizer: torch.optim.Optimizer) -> str:
    """The options of ``optimizer`` that differ from its class's defaults, to check first."""
    try:
        params = inspect.signature(type(optimizer)).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    changed = []
    for key, value in optimizer.defaults.items():
        default = params[key].default if key in params else None
        simple = isinstance(value, (bool, int, float, str, tuple))
        # (a default of None is worked out from the others, as LBFGS's max_eval)
        if (
            key != "lr"
            and simple
            and default not in (None, inspect.Parameter.empty)
            and value != default
        ):
            changed.append(f"{key}={value!r}")
    if not changed:
        return "it runs with its default options: check its state and the parameters it steps"
    return f"check its options that differ from the defaults: {', '.join(changed)}"


class NonFiniteWatch:
    """The default check (``nonfinite = "raise"``), with no host read per step: each step's
    loss (and clipping's gradient norm) is kept as the device tensor it is (a list append: no
    kernel, no sync), and the loop checks them all in one read where it reads values anyway
    (a step row, a checkpoint, an epoch's end), naming the first bad step. The steps in
    between were taken, so the weights are no longer finite; they are never checkpointed or
    exported (a checkpoint checks first), and the last good checkpoint stays. A per-step
    ``.item()`` makes the CPU wait for every step to finish before queueing the next (Hugging
    Face removed one: "hurt performance by like 2X" on TPU); ``"strict"`` keeps that check,
    for who wants a non-finite step never taken."""

    def __init__(self, spike: float = 0.0) -> None:
        self.pending: list[tuple[torch.Tensor, ...]] = []  # each step's values since `base`
        self.base = 0  # the step before the first pending one
        # train.loss_spike: a finite loss over `spike` times the median of the steps before
        self.spike = spike
        # taken steps' losses and where they were: (step, epoch, first batch, last batch)
        self.steps: list[tuple[torch.Tensor, tuple[int, int, int, int]]] = []
        self.recent: list[float] = []  # the last SPIKE_WINDOW checked losses

    def state_dict(self) -> dict[str, Any]:
        """The loss-spike guard's window (the last checked losses): what a resumed run
        measures its next steps against, as the uninterrupted run does. Read after
        :meth:`check` (as a checkpoint does), so no step is pending."""
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = [float(value) for value in state["recent"]][-SPIKE_WINDOW:]

    def observe_step(self, loss: torch.Tensor, state: TrainState, batches: int) -> None:
        """A taken step's loss and where it was (for ``spike``: checked with the rest)."""
        first, last = state.batch_in_epoch - batches + 1, state.batch_in_epoch
        self.steps.append((loss, (state.step, state.epoch + 1, first, last)))  # (no f-string)

    def observe(self, *values: torch.Tensor) -> None:
        """One step's loss (and its gradient norm, when clipping computed one)."""
        self.pending.append(values)

    def check(self, state: TrainState, world: Any = None) -> None:
        """Raise :class:`NonFiniteError` if a step since the last check was not finite (one
        host read; with several processes a collective, so all stop together); then count
        from ``state.step``."""
        first = -1  # the first bad step, counted from `base`
        if self.pending:
            values = torch.stack([value for step in self.pending for value in step])
            finite = torch.isfinite(values.detach()).view(len(self.pending), -1).all(dim=1)
            if not bool(finite.all()):
                first = int(torch.argmin(finite.int())) + 1
        if world is not None and world.distributed:
            from glassloop.distributed.world import all_reduce

            value = float(self.base + first) if first >= 0 else math.inf
            agreed = float(all_reduce(torch.tensor([value], dtype=torch.float64), "min"))
            first = int(agreed) - self.base if math.isfinite(agreed) else -1
        if first >= 0:
            raise NonFiniteError(
                f"train: the loss (or the clipped gradient norm) is NaN/inf at step "
                f"{self.base + first}, seen at step {state.step} (checked without stopping "
                "every step: the weights since are not finite and are not saved; the last "
                "good checkpoint is intact). Lower the learning rate, clip gradients "
                "(train.clip_grad_norm), check the data for NaN/inf, or set train.nonfinite "
                "= 'strict' (never take such a step) or 'skip'"
            )
        self.pending = []
        self.base = state.step
        if self.steps:
            self._check_spikes(world)

    def _check_spikes(self, world: Any) -> None:
        """Raise :class:`LossSpikeError` at the first step whose loss is more than ``spike``
        times the median of the :data:`SPIKE_WINDOW` steps before it (once that many are
        known); one host read of the pending steps' losses (with several processes, one
        collective: they all stop, at the first step any of them saw).

        Measured as a distance: a loss more than ``spike - 1`` times ``|median|`` above the
        median, which for positive losses is "over ``spike`` times the median" and also works
        for losses below zero (a negative log-likelihood of densities, an ELBO): a median of
        -2 with ``spike = 10`` stops at a loss over 16. A median of exactly 0 has no scale to
        measure against: those steps are not checked."""
        values = torch.stack([loss.detach().double() for loss, _ in self.steps]).cpu().tolist()
        spike, found = math.inf, ""
        for i, value in enumerate(values):
            if len(self.recent) == SPIKE_WINDOW:
                median = statistics.median(self.recent)
                scale = abs(median)
                if scale and value - median > (self.spike - 1) * scale and math.isinf(spike):
                    times = value / median if median > 0 else (value - median) / scale
                    what = "the median" if median > 0 else "|median| above the median"
                    found = f"{value:.6g}, {times:.3g} times {what} {median:.6g}"
                    spike = float(i)
                self.recent.pop(0)
            self.recent.append(value)
        places = [place for _, place in self.steps]
        self.steps = []
        if world is not None and world.distributed:
            spike = float(all_reduce(torch.tensor([spike], dtype=torch.float64), "min"))
        if math.isfinite(spike):
            what = f": {found}" if found else " (seen by another process)"
            raise LossSpikeError(
                f"train: a loss spike at {_place(*places[int(spike)])}{what} of the {SPIKE_WINDOW} "
                f"steps before (train.loss_spike = {self.spike:g}); nothing after it is "
                "saved, the last good checkpoint is intact. Inspect those batches (their "
                "positions in the epoch's order), lower the learning rate or clip gradients"
            )


def _place(step: int, epoch: int, first: int, last: int) -> str:
    batches = f"batch {last}" if first == last else f"batches {first}-{last}"
    return f"step {step} (epoch {epoch}, {batches})"


class NonFinitePolicy:
    """``"strict"``: stop before the first non-finite step is taken, saying where and which
    parameter's gradient went first; ``"skip"``: drop the step, count it, stop after
    ``max_skips`` in a row. Both read the loss and the gradients on the host every step;
    the default, ``"raise"``, is :class:`NonFiniteWatch` (none per step)."""

    def __init__(self, policy: str = "raise", max_skips: int = 10) -> None:
        if policy not in ("raise", "strict", "skip"):
            raise GlassloopError(
                f"train.nonfinite must be 'raise', 'strict' or 'skip', got {policy!r}"
            )
        check_range("max_skips", max_skips, AT_LEAST_1, where="NonFinitePolicy")
        self.policy = policy
        self.max_skips = max_skips

    def __repr__(self) -> str:  # (what a run built in Python records, compared on resume)
        return f"NonFinitePolicy({self.policy!r}, max_skips={self.max_skips})"

    def __call__(
        self, model: nn.Module, loss: torch.Tensor, state: TrainState, num_batches: int
    ) -> None:
        first, last = state.batch_in_epoch + 1, state.batch_in_epoch + num_batches
        batches = f"batch {last}" if first == last else f"batches {first}-{last}"
        where = f"step {state.step + 1} (epoch {state.epoch + 1}, {batches})"
        bad = next(
            (
                name
                for name, p in model.named_parameters()
                # (FSDP: this process's shard; a sharded whole would need every process)
                if p.grad is not None and not _finite_values(local(p.grad))
            ),
            None,
        )
        culprit = f"; first non-finite gradient: '{bad}'" if bad else ""
        value = loss.item()
        what = (
            f"loss is {value}"
            if not math.isfinite(value)
            else f"gradient is not finite (loss {value:.6g})"
        )
        if self.policy != "skip":
            raise NonFiniteError(
                f"train: {what} at {where}{culprit}. Lower the learning rate, "
                "clip gradients (train.clip_grad_norm), check the data for NaN/inf, or set "
                "train.nonfinite = 'skip'"
            )
        state.skipped_steps += 1
        state.consecutive_nonfinite += 1
        if state.consecutive_nonfinite >= self.max_skips:
            raise NonFiniteError(
                f"train: {state.consecutive_nonfinite} non-finite steps in a row, the last at "
                f"{where}{culprit}; stopping (train.max_nonfinite_skips = {self.max_skips})"
            )


def all_finite(
    values: list[torch.Tensor], params: list[torch.Tensor], world: World, *, sharded: bool = False
) -> bool:
    """Whether ``values`` (a step's loss, a clipped norm) and the gradients of ``params`` are
    all finite, decided alike in every process: one host read per step, the price of never
    stepping on a NaN (``nonfinite="strict"`` and ``"skip"``). ``sharded``: an FSDP run,
    each process checks its own shards."""
    checked = list(values)
    if params:
        # Fused L2 norms (one kernel on GPU; 51 us/step on the tutorial MLP on this CPU;
        # the inf-norm would be 885 us): finite exactly when every gradient is.
        grads = [local(p.grad) if sharded else p.grad for p in params if p.grad is not None]
        # (a sparse gradient, nn.Embedding(sparse=True)'s: the norm of its stored values)
        grads = [grad._values() if grad.is_sparse else grad for grad in grads]
        checked.extend(torch._foreach_norm(grads))
    # A sum is finite only if all its terms are; item() is ~25x cheaper than torch.isfinite
    # on a CPU scalar. (Summed in float32: half-precision norms each finite can overflow.)
    check = torch.stack(checked).sum(dtype=torch.float32) if len(checked) > 1 else checked[0]
    finite = math.isfinite(check.item())
    if world.distributed:  # every process takes the same decision
        finite = not all_reduce(torch.tensor([float(not finite)]), "max").item()
    return finite
