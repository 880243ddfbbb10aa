"""evaluate() and predict(): eval mode, no gradients, averages over samples, for every task
(:mod:`glassloop.tasks`)."""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from glassloop.batch import batch_size_of, required_inputs, split_batch, split_inputs
from glassloop.data.hf_datasets import loader_for
from glassloop.device import move_to_device
from glassloop.distributed.fsdp import evenly, is_sharded
from glassloop.distributed.world import SINGLE, World, distributed_job, gather_objects
from glassloop.errors import ConfigError, DataError
from glassloop.evaluation.metric_names import REPORTED, check_metric_name, make_metric
from glassloop.evaluation.metrics import ClassificationSums, MultilabelSums, RegressionSums
from glassloop.precision import autocast
from glassloop.storage.file_names import check_name
from glassloop.tasks import (
    LABEL_TASKS,
    activate,
    check_same_shape,
    class_scores,
    head_of,
    model_loss,
    outputs_are_probabilities,
    own_shift,
    predicted_task,
    prediction_of,
    reduction_of,
    resolve_task,
    task_of,
)

LossFn = Callable[..., torch.Tensor]
T = TypeVar("T")
TaskSums = ClassificationSums | MultilabelSums | RegressionSums


class Metric(Protocol):
    """A streaming metric: a torchmetrics ``Metric`` or anything with the same three methods
    (correct under DDP when ``compute`` adds up every process's state, as torchmetrics does).
    ``update`` receives what :func:`metric_inputs` gives: probabilities for classification
    and multilabel (tokens flattened), outputs for a regression, and the targets."""

    def reset(self) -> None: ...
    def update(self, prediction: torch.Tensor, target: Any) -> None: ...
    def compute(self) -> Any: ...
    def to(self, device: torch.device) -> Any: ...


def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    loss_fn: LossFn | None,
    *,
    task: str = "auto",
    device: torch.device | None = None,
    ignore_index: int = -100,
    metrics: Mapping[str, Metric | str] | Sequence[str] | None = None,
    loss_reduction: str = "auto",
    heads: Mapping[str, str] | None = None,
    outputs: str = "auto",
    live: Callable[[torch.Tensor, torch.Tensor, TaskSums | None], None] | None = None,
) -> dict[str, Any]:
    """Return ``loss`` (mean over samples, or over labelled tokens; a loss that sums over its
    batch, ``loss_reduction="sum"`` or a loss module's ``reduction``, per sample too) and the task's
    metrics (:mod:`glassloop.tasks`): for classification ``accuracy``, ``confusion`` (rows true,
    columns predicted) and ``report`` (per-class precision/recall/F1/support); for a regression
    ``mae``, ``rmse``, ``r2``; ... plus every metric of ``metrics`` by its name: names of
    :mod:`glassloop.evaluation.metric_names` or ``{name: metric object}`` (:class:`Metric`).
    ``loss_fn=None``: the model computes its own loss (it gets the target as ``labels=``).
    ``heads``: a task per head of a model with several (:func:`glassloop.tasks. resolve_heads`):
    each head's metrics on its part of the target, as ``<head>_<metric>``. ``outputs``: what the
    model returns (:func:`glassloop.tasks.outputs_are_probabilities`: ``"auto"`` sees a BCELoss or a
    final ``nn.Sigmoid``/``nn.Softmax``). ``live``: called after each batch with the running loss
    sum, its weight and the task's sums (on the device: a progress bar reads them when it redraws).

    The tutorial averages batch means (``test_loss / num_batches``), which over-weights a
    short last batch; here every sample counts once. Inside a multi-process job each process
    evaluates its own shard and the sums are added across processes.

    >>> model = nn.Linear(4, 3)
    >>> data = [(torch.zeros(5, 4), torch.tensor([0, 1, 2, 0, 1]))]
    >>> sorted(evaluate(model, data, nn.CrossEntropyLoss()))
    ['accuracy', 'confusion', 'loss', 'report']
    """
    loader = loader_for(loader, model=model)  # a Hugging Face dataset: its batches
    task = task_of(model, resolve_task(task, loss_fn))
    # (BCELoss, a final nn.Sigmoid: decided at 0.5, never put through a sigmoid again)
    probabilities = outputs_are_probabilities(outputs, model, loss_fn)
    summed = reduction_of(loss_fn, loss_reduction) == "sum"
    device = device if device is not None else model_device(model)
    own_loss = loss_fn is None
    wanted = metric_table(metrics, task, heads)
    extra: dict[str, Metric] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    weight = torch.zeros((), dtype=torch.float64, device=device)
    sums: TaskSums | None = None
    head_sums: dict[str, TaskSums | None] = {}
    shift: int | None = None  # how the model's own loss lines tokens up with labels (own_shift)
    first = True
    was_training = model.training
    model.eval()  # dropout off, batch-norm uses its running statistics
    try:
        with torch.no_grad():
            # (FSDP: every process runs as many forwards, each a collective)
            for batch in evenly(model, loader, device, own_loss=own_loss):
                inputs, target = split_batch(
                    move_to_device(batch, device), labels_to_model=own_loss
                )
                output = model(*inputs[0], **inputs[1])
                loss = loss_fn(output, target) if loss_fn is not None else model_loss(output)
                if heads:  # a task per head: the loss per sample, each head's own metrics
                    samples = batch_size_of(target, inputs)
                    loss_sum += loss.detach().to(torch.float64) * (1 if summed else samples)
                    weight += samples
                    update_heads(head_sums, heads, output, target, device, ignore_index)
                    continue
                prediction = prediction_of(output, with_loss=own_loss)
                if first:  # (decided on the first batch)
                    shift = own_shift(loss, prediction, target, ignore_index) if own_loss else 0
                if shift:  # position t predicts label t+1, as the model's loss counts it
                    prediction, target = prediction[:, :-1], target[:, 1:]
                labels = class_scores(prediction, target) if shift is not None else None
                # A mean loss times what it is the mean over (samples, or labelled tokens:
                # a padded batch's loss is their mean) is the batch's sum.
                if labels is not None:
                    n: Any = (labels[1] != ignore_index).sum()
                else:
                    n = batch_size_of(target, inputs)
                loss_sum += loss.detach().to(torch.float64) * (1 if summed else n)
                weight += n
                if first:  # sized from the first batch (metric objects reset once)
                    sums = task_sums(
                        task, prediction, target, labels, device, ignore_index, probabilities
                    )
                    extra = metric_objects(wanted, task, prediction, labels, device)
                    first = False
                if sums is not None:
                    update_sums(sums, prediction, target, labels)
                if extra:
                    metric_input = metric_inputs(task, prediction, target, labels, probabilities)
                    for metric in extra.values():
                        metric.update(*metric_input)
                if live is not None:
                    live(loss_sum, weight, sums)
    finally:
        model.train(was_training)
    if distributed_job():  # each process saw its shard; report the whole validation set
        from glassloop.distributed.world import all_reduce

        totals = all_reduce(torch.stack([loss_sum, weight]).cpu())
        loss_sum, weight = totals[0], totals[1]
        for found in (sums, *head_sums.values()):
            if found is not None:
                found.all_reduce()
    if float(weight) == 0:
        raise DataError("data: the evaluation set is empty")
    result: dict[str, Any] = {"loss": float(loss_sum) / float(weight)}
    if sums is not None:
        result.update(sums.compute())
    for name, found in head_sums.items():
        if found is not None:
            result.update({f"{name}_{key}": value for key, value in found.compute().items()})
    if task == "language-model":
        result["perplexity"] = math.exp(min(result["loss"], 700.0))  # (exp overflows past 709)
    for name, metric in extra.items():
        value = metric.compute()
        result[name] = (
            float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        )
    return result


def update_heads(
    sums: dict[str, TaskSums | None],
    heads: Mapping[str, str],
    output: Any,
    target: Any,
    device: torch.device,
    ignore_index: int,
) -> None:
    """Add a batch to each head's task sums (sized from the first batch; ``None``: a head
    whose target does not have its task's shape reports nothing)."""
    for i, (name, task) in enumerate(heads.items()):
        prediction, goal = head_of(output, name, i), head_of(target, name, i)
        labels = class_scores(prediction, goal) if task in LABEL_TASKS else None
        if name not in sums:
            sums[name] = task_sums(task, prediction, goal, labels, device, ignore_index)
        if (found := sums[name]) is not None:
            update_sums(found, prediction, goal, labels)


def metric_table(
    metrics: Mapping[str, Metric | str] | Sequence[str] | None,
    task: str,
    heads: Mapping[str, str] | None = None,
) -> dict[str, Metric | str]:
    """``{name: metric object or name}``; names are checked for ``task`` here, before any
    batch is evaluated. With a task per head (``heads``) each head's metrics are its task's:
    more would have no prediction to take, so they are refused, not ignored."""
    if metrics is None:
        return {}
    if heads and metrics:
        raise ConfigError(
            "metrics: with a task per head, each head gets its task's metrics "
            "(val_<head>_<metric>); compute others in an evaluate() override"
        )
    table: dict[str, Metric | str] = (
        dict(metrics) if isinstance(metrics, Mapping) else {name: name for name in metrics}
    )
    for name, metric in table.items():
        check_name(name, "metrics: metric")  # (val_<name> names a column and a plot)
        if isinstance(metric, str):
            check_metric_name(metric, task)
    # (a name the task reports anyway: once; a metric object is never compared, its == is
    # torchmetrics' arithmetic)
    reported = REPORTED.get(task, ())
    return {name: m for name, m in table.items() if not (isinstance(m, str) and m in reported)}


def metric_objects(
    wanted: dict[str, Metric | str],
    task: str,
    prediction: torch.Tensor,
    labels: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device,
) -> dict[str, Metric]:
    """Named metrics built for the first batch's number of classes or outputs; objects reset
    (one object serves every evaluation of a run)."""
    objects: dict[str, Metric] = {}
    outputs = int(labels[0].shape[-1]) if labels is not None else max(1, prediction[0].numel())
    for name, metric in wanted.items():
        if isinstance(metric, str):
            metric = make_metric(metric, task, outputs).to(device)
        metric.reset()
        objects[name] = metric
    return objects


def metric_inputs(
    task: str,
    prediction: torch.Tensor,
    target: Any,
    labels: tuple[torch.Tensor, torch.Tensor] | None,
    probabilities: bool = False,
) -> tuple[torch.Tensor, Any]:
    """What a :class:`Metric` is updated with: class probabilities ``(M, C)`` and labels
    ``(M,)`` for classification (tokens flattened), label probabilities and 0/1 integer
    targets for multilabel, outputs and targets (``(N,)`` for one output) otherwise."""
    if labels is not None and task in LABEL_TASKS:
        return activate(task, labels[0], probabilities=probabilities), labels[1]
    if task == "multilabel" and isinstance(target, torch.Tensor):
        goal = target.reshape(prediction.shape) if one_column(prediction, target) else target
        return activate(task, prediction, probabilities=probabilities), goal.round().long()
    if task == "regression" and isinstance(target, torch.Tensor):
        flat = prediction.float().reshape(prediction.shape[0], -1)
        goal = target.float().reshape(target.shape[0], -1)
        return (flat.squeeze(1), goal.squeeze(1)) if flat.shape[1] == 1 else (flat, goal)
    return activate(task, prediction), target


def task_sums(
    task: str,
    prediction: torch.Tensor,
    target: Any,
    labels: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device,
    ignore_index: int,
    probabilities: bool = False,
) -> TaskSums | None:
    """The sums that give ``task``'s metrics, sized from the first batch (``labels``: its
    :func:`class_scores`; ``None``: the batch does not have the task's shape, only the loss
    is reported)."""
    if not isinstance(target, torch.Tensor):
        return None
    if task in LABEL_TASKS:
        if labels is None:
            if task != "auto":  # (an "auto" task's metrics are there when the batch fits)
                skipped(task, prediction, target, "integer labels, one per output row")
            return None
        return ClassificationSums(int(labels[0].shape[-1]), device, ignore_index)
    fits = prediction.shape == target.shape or one_column(prediction, target)
    if task == "multilabel" and prediction.ndim in (1, 2) and fits:
        labels_per_sample = int(prediction.shape[1]) if prediction.ndim == 2 else 1
        return MultilabelSums(labels_per_sample, device, probabilities=probabilities)
    if task == "multilabel":
        skipped(task, prediction, target, "a 0/1 target per output")
    if task == "regression":
        check_same_shape(prediction, target, "evaluate")
        return RegressionSums(max(1, prediction[0].numel()), device)
    return None


def one_column(prediction: torch.Tensor, target: torch.Tensor) -> bool:
    """A yes/no model's ``(N, 1)`` outputs against ``(N,)`` targets (what
    ``BCELoss()(out.squeeze(), t)`` trains): the same values, one column."""
    return (
        prediction.ndim == 2 and prediction.shape[1] == 1 and target.shape == prediction.shape[:1]
    )


def skipped(task: str, prediction: torch.Tensor, target: torch.Tensor, wanted: str) -> None:
    """Say (once per shape) that a task's metrics are not computed: never a silent none."""
    warnings.warn(
        f"evaluate: no {task} metrics: the outputs are shaped {tuple(prediction.shape)} and "
        f"the targets {tuple(target.shape)}, not {wanted}; only the loss is reported",
        stacklevel=3,
    )


def update_sums(
    sums: TaskSums,
    prediction: torch.Tensor,
    target: Any,
    labels: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    if isinstance(sums, ClassificationSums):
        if labels is not None:
            sums.update(*labels)
    elif one_column(prediction, target):  # (N, 1) outputs and (N,) targets: one label each
        sums.update(prediction, target.reshape(prediction.shape))
    else:
        sums.update(prediction, target)


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters (or buffers) are; the CPU for a model without any."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class FirstBatches:
    """The first ``limit`` batches of a loader that has a ``len()``, with that length."""

    def __init__(self, loader: Sized, limit: int) -> None:
        self.loader, self.limit = loader, limit

    def __len__(self) -> int:
        return min(len(self.loader), self.limit)

    def __iter__(self) -> Iterator[Any]:
        iterable: Iterable[Any] = self.loader  # type: ignore[assignment]
        return itertools.islice(iterable, self.limit)  # (its one iter(): data.position.iterate)


def first_batches(loader: Iterable[Any], limit: int, *, counted: bool = False) -> Iterable[Any]:
    """The first ``limit`` batches of ``loader`` (``limit_batches``), counted when it can be:
    an FSDP evaluation evens the processes' batch counts out (``counted``: a loader without
    a ``len()`` is refused)."""
    if isinstance(loader, Sized):
        return FirstBatches(loader, limit)
    if counted:
        raise DataError("data: with train.strategy = 'fsdp' the validation loader needs a len()")
    return itertools.islice(loader, limit)


def gathered_outputs(
    model: nn.Module,
    loader: Iterable[Any],
    device: torch.device,
    precision: str,
    world: World,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression's outputs and targets of every process's shard of ``loader`` (a
    collective with several processes: gathered in rank order), for the report's
    predicted-vs-true plot."""
    with autocast(precision, device):
        outputs, targets = predictions_and_targets(model, loader, device)
    if not world.distributed:
        return outputs, targets
    parts = gather_objects((outputs, targets))  # (pickled between our own processes)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def predictions_and_targets(
    model: nn.Module, loader: Iterable[Any], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression's outputs and targets over ``loader`` (on the CPU), for its
    predicted-vs-true plot."""
    was_training = model.training
    model.eval()
    outputs, targets = [], []
    try:
        with torch.inference_mode():
            for batch in evenly(model, loader, device):
                inputs, target = split_batch(move_to_device(batch, device))
                outputs.append(prediction_of(model(*inputs[0], **inputs[1])).float().cpu())
                targets.append(torch.as_tensor(target).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(outputs), torch.cat(targets)


def predict(
    model: nn.Module,
    data: torch.Tensor | Iterable[Any],
    *,
    task: str = "auto",
    batch_size: int = 256,
    device: torch.device | None = None,
    classes: int | None = None,
    probabilities: bool | None = None,
) -> torch.Tensor:
    """What the task means by a prediction (:func:`glassloop.tasks.activate`): class
    probabilities (softmax) for classification, label probabilities (sigmoid) for
    multilabel, the outputs as they are for regression and custom tasks; outputs that are
    ``probabilities`` already as they are (``None``: when the model's last module is an
    ``nn.Sigmoid`` or ``nn.Softmax``); on the CPU, in input order, under
    ``torch.inference_mode``. ``task="auto"``: the task a model from
    :func:`glassloop.load_model` carries, else a softmax over two or more columns and a
    single column as it is.

    ``data`` is a tensor of inputs (split into batches of ``batch_size``), a tuple of such
    tensors (the inputs of a model with several: ``predict((a, b))``), or an iterable of
    batches. A batch's target, if any, is dropped: a tuple with exactly as many elements as
    the model's ``forward`` requires is all inputs, a longer one ends with the target.
    Class probabilities are in the last dimension; for a model with torch's ``(N, C, T)``
    output layout pass ``classes=C`` and they are moved there.

    >>> probs = predict(nn.Linear(4, 3), torch.zeros(2, 4))
    >>> probs.shape, bool(torch.allclose(probs.sum(1), torch.ones(2)))
    (torch.Size([2, 3]), True)
    """
    task = task_of(model, resolve_task(task, None))
    if probabilities is None:
        probabilities = outputs_are_probabilities("auto", model, None)
    convert = functools.partial(activated, task=task, classes=classes, probabilities=probabilities)
    outputs = model_outputs(model, data, batch_size, device, convert)
    return torch.cat(outputs) if outputs else torch.empty(0)


def activated(
    output: Any, *, task: str, classes: int | None = None, probabilities: bool = False
) -> torch.Tensor:
    """One batch's prediction as :func:`predict` returns it, on the CPU."""
    return activate(task, prediction_of(output), classes, probabilities=probabilities).cpu()


def heads_activated(output: Any, *, heads: Mapping[str, str]) -> tuple[bool, list[torch.Tensor]]:
    """One batch's prediction of every head (on the CPU), and whether the model returned a
    tuple."""
    found = [
        activate(task, head_of(output, name, i)).cpu()
        for i, (name, task) in enumerate(heads.items())
    ]
    return isinstance(output, (tuple, list)), found


def predict_heads(
    model: nn.Module,
    data: torch.Tensor | Iterable[Any],
    heads: Mapping[str, str],
    *,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
    """:func:`predict` for a model with several heads, a task each
    (:func:`glassloop.tasks.resolve_heads`): every head's prediction, each what its own task
    means, in a dict by head name (a tuple when the model returns one).

    >>> class Two(nn.Module):
    ...     def forward(self, x):
    ...         return {"kind": x[:, :2], "size": x[:, 2:]}
    >>> out = predict_heads(Two(), torch.zeros(4, 3), {"kind": "classification",
    ...                                                "size": "regression"})
    >>> out["kind"][0].tolist(), out["size"].shape
    ([0.5, 0.5], torch.Size([4, 1]))
    """
    convert = functools.partial(heads_activated, heads=heads)
    batches = model_outputs(model, data, batch_size, device, convert)
    joined = [
        torch.cat([found[i] for _, found in batches]) if batches else torch.empty(0)
        for i in range(len(heads))
    ]
    as_tuple = bool(batches) and batches[0][0]
    return tuple(joined) if as_tuple else dict(zip(heads, joined, strict=True))


def model_outputs(
    model: nn.Module,
    data: torch.Tensor | Iterable[Any],
    batch_size: int,
    device: torch.device | None,
    convert: Callable[[Any], T],
) -> list[T]:
    """``convert`` of the model's output on each batch of ``data`` (see :func:`predict`), in
    eval mode under ``torch.inference_mode``; the model's mode is put back at the end."""
    device = device if device is not None else model_device(model)
    # (FSDP: the processes' batch counts are evened out, which needs a len())
    if is_sharded(model) and not isinstance(data, (torch.Tensor, Sized)):
        raise DataError("data: with train.strategy = 'fsdp', predict needs a len()")
    batches: Iterable[Any] = loader_for(data, model=model, batch_size=batch_size, world=SINGLE)
    if isinstance(data, torch.Tensor):
        batches = torch.split(data, batch_size)
    elif isinstance(data, tuple) and data and all(isinstance(t, torch.Tensor) for t in data):
        # (a, b): the inputs of a model with several, one example per row of each
        if len({len(t) for t in data}) != 1:
            raise DataError(
                f"data: predict((a, b, ...)) takes inputs of one length each (one example per "
                f"row), got lengths {[len(t) for t in data]}; for one batch pass [(a, b)]"
            )
        batches = zip(*(t.split(batch_size) for t in data), strict=True)
    positional = required_inputs(model)
    was_training = model.training
    model.eval()
    converted: list[T] = []
    try:
        with torch.inference_mode():
            for batch in evenly(model, batches, device, predicting=True):
                args, kwargs = split_inputs(move_to_device(batch, device), positional)
                converted.append(convert(model(*args, **kwargs)))
    finally:
        model.train(was_training)
    return converted


class Shows(Protocol):
    """What a validation shows on the console (:class:`glassloop.tracking.console.
    ProgressReporter`): its bar, and its running numbers on it."""

    bar: bool

    def validation(self, loader: Iterable[Any]) -> Iterable[Any]: ...
    def live_validation(self, loss_sum: Any, weight: Any, sums: Any) -> None: ...


class Evaluating(Protocol):
    """What :func:`evaluate_with` and :func:`predict_with` read of a Trainer."""

    @property
    def eval_model(self) -> nn.Module: ...
    @property
    def last_eval(self) -> dict[str, Any] | None: ...

    loss_fn: LossFn | None
    task: str
    heads: dict[str, str] | None
    probabilities: bool
    device: torch.device
    precision: str
    loss_reduction: str
    ignore_index: int

    @property
    def metrics(self) -> Mapping[str, Metric | str]: ...
    @property
    def console(self) -> Shows: ...


def evaluate_with(trainer: Evaluating, loader: Iterable[Any]) -> dict[str, Any]:
    """:func:`evaluate` as ``trainer`` evaluates: its evaluated model (the EMA's when there
    is one), loss, task and metrics, under its precision's autocast, on its console's
    validation bar when it draws one."""
    console, model = trainer.console, trainer.eval_model
    with autocast(trainer.precision, trainer.device):
        return evaluate(
            model,
            console.validation(loader_for(loader, model=model)),  # (a dataset: its batches)
            trainer.loss_fn,
            task=trainer.task,
            device=trainer.device,
            loss_reduction=trainer.loss_reduction,
            ignore_index=trainer.ignore_index,
            metrics=trainer.metrics,
            heads=trainer.heads,
            outputs="probabilities" if trainer.probabilities else "logits",
            live=console.live_validation if console.bar else None,  # the bar's numbers
        )


def predict_with(
    trainer: Evaluating, data: torch.Tensor | Iterable[Any], batch_size: int, classes: int | None
) -> Any:
    """:func:`predict` (a task per head: :func:`predict_heads`) as ``trainer`` predicts: its
    evaluated model, under its precision's autocast; a loss of the user's says nothing of
    the task, and the outputs are returned as they are."""
    common: dict[str, Any] = {"batch_size": batch_size, "device": trainer.device}
    with autocast(trainer.precision, trainer.device):
        if trainer.heads:
            return predict_heads(trainer.eval_model, data, trainer.heads, **common)
        task = predicted_task(trainer.task, trainer.loss_fn, trainer.last_eval)
        common.update(task=task, classes=classes, probabilities=trainer.probabilities)
        return predict(trainer.eval_model, data, **common)
