"""What a model is trained to do, and what that means for its outputs and predictions.

- ``classification`` (from CrossEntropyLoss, NLLLoss): ``predict`` gives softmax
  probabilities; metrics accuracy, confusion, per-class report.
- ``multilabel`` (from BCEWithLogitsLoss): sigmoid probabilities per label; accuracy (per
  label decision), exact_match, f1_micro, f1_macro. From BCELoss too: the model ends in a
  sigmoid, its outputs are probabilities already (decided at 0.5, returned as they are).
- ``regression`` (from MSELoss, L1Loss, HuberLoss, SmoothL1Loss): the outputs as they are;
  mae, rmse, r2.
- ``language-model`` (set it; a per-token CrossEntropyLoss): softmax over the vocabulary;
  accuracy over labelled tokens, perplexity.
- ``custom`` (any other loss, or the model's own): the outputs as they are; the loss only.
- several heads, a task each (``{"kind": "classification", "size": "regression"}``,
  :func:`resolve_heads`): each head's metrics on its part of the target, every head predicted.

The task is inferred from the loss when that is unambiguous (the loss classes above and
their functional forms, ``F.cross_entropy`` & co.) and can always be set
(``Trainer(task="regression")``, ``train.task`` in a config). With any other loss, or the
model's own, the task stays ``"auto"``: evaluation reports classification metrics when the
targets are integer labels that fit the outputs (and only the loss otherwise), and
``predict`` returns softmax probabilities, except with a loss function of the user's whose
last evaluation found no such labels: the outputs as they are then, said once
(:func:`predicted_task`); set the task for anything else. Outputs that are probabilities
already (``outputs="probabilities"``, a BCELoss, a final ``nn.Sigmoid``/``nn.Softmax``) are
never put through a second sigmoid or softmax (:func:`outputs_are_probabilities`). A softmax over a
single output column is always 1.0: ``"auto"`` never takes one (it returns that column as
it is and says so once), and a classification needs two outputs or more.

**Which part of a model's output is the prediction** (one rule, for training, evaluation and
``predict``): a tensor is the prediction; a dict or a Hugging Face ``ModelOutput`` gives its
``"logits"`` (else its first tensor that is not ``"loss"``); an object gives its ``.logits``;
a tuple or list gives its first element — except when the model computed its own loss in that
call, where it is ``(loss, prediction, ...)`` as Hugging Face models return with
``return_dict=False``.

**The model's own loss** (``loss_fn=None``): the batch's target is passed to the model as
``labels=`` (what Hugging Face models expect) and the loss is the output's ``"loss"`` /
``.loss`` / first element.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from glassloop.errors import ConfigError, DataError, ModelError
from glassloop.rules import loss_fits
from glassloop.storage.file_names import check_name

TASKS = ("classification", "multilabel", "regression", "language-model", "custom")
# Tasks whose targets are class labels (per sample or per token); "auto" is treated as one
# when its targets turn out to be labels that fit the outputs.
LABEL_TASKS = ("classification", "language-model", "auto")
LOSS_TASKS = {
    nn.CrossEntropyLoss: "classification",
    nn.NLLLoss: "classification",
    nn.BCEWithLogitsLoss: "multilabel",
    nn.BCELoss: "multilabel",  # (on probabilities: see takes_probabilities)
    nn.MSELoss: "regression",
    nn.L1Loss: "regression",
    nn.HuberLoss: "regression",
    nn.SmoothL1Loss: "regression",
}
FUNCTION_TASKS = {
    F.cross_entropy: "classification",
    F.nll_loss: "classification",
    F.binary_cross_entropy_with_logits: "multilabel",
    F.binary_cross_entropy: "multilabel",
    F.mse_loss: "regression",
    F.l1_loss: "regression",
    F.huber_loss: "regression",
    F.smooth_l1_loss: "regression",
}


class Resolved(NamedTuple):
    """What a model is trained to do, as the Trainer resolves it once (:func:`resolve`)."""

    task: str  # the model's (with a task per head: "custom")
    heads: dict[str, str] | None  # each head's task, or None
    probabilities: bool  # its outputs are probabilities already: never through a second one
    loss_reduction: str  # "sum": the loss adds up over a batch (reported per sample)
    train_accuracy: bool  # the training labels it gets right are counted each step


def resolve(
    task: str | Mapping[str, str],
    loss_fn: Any,
    model: nn.Module,
    outputs: str = "auto",
    loss_reduction: str = "auto",
    train_accuracy: bool = False,
) -> Resolved:
    """The Trainer's ``task``, ``outputs``, ``loss_reduction`` and ``train_accuracy``
    resolved against its ``model`` and ``loss_fn``, each refused in one line where it does
    not fit (:func:`resolve_heads`, :func:`resolve_task`, :func:`outputs_are_probabilities`,
    :func:`reduction_of`, :func:`check_train_accuracy`)."""
    task, heads = resolve_heads(task)
    task = resolve_task(task, loss_fn)
    probabilities = outputs_are_probabilities(outputs, model, loss_fn)
    reduction = reduction_of(loss_fn, loss_reduction)
    counted = check_train_accuracy(train_accuracy, task, loss_fn)
    return Resolved(task, heads, probabilities, reduction, counted)


def resolve_task(task: str, loss_fn: Any) -> str:
    """``task`` checked, or for ``"auto"`` the task ``loss_fn`` implies (``"auto"`` when it
    implies none: see this module's docstring).

    >>> resolve_task("auto", nn.MSELoss()), resolve_task("auto", F.cross_entropy)
    ('regression', 'classification')
    """
    by_function = (t for function, t in FUNCTION_TASKS.items() if loss_fn is function)
    implied = LOSS_TASKS.get(type(loss_fn)) or next(by_function, "auto")
    if task == "auto":
        return implied
    if task not in TASKS:
        raise ConfigError(f"task must be 'auto' or one of {', '.join(TASKS)}; got {task!r}")
    if implied != "auto" and not loss_fits(implied, task):
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise ConfigError(
            f"task {task!r} does not fit the loss {name}, a {implied} loss (it would train "
            f"and report as another task without an error): give a {task} loss, or "
            f"task={implied!r} (or 'custom': the loss only)"
        )
    return task


def resolve_heads(task: str | Mapping[str, str]) -> tuple[str, dict[str, str] | None]:
    """The model's task and, for a model with several heads, each head's
    (``{"kind": "classification", "size": "regression"}``): every head's task stated (no
    ``"auto"``: a joint loss implies none), the model's own is then ``"custom"``.

    >>> resolve_heads({"kind": "classification", "size": "regression"})[0]
    'custom'
    """
    if not isinstance(task, Mapping):
        return task, None
    if not task:
        raise ConfigError("task: a task per head needs at least one head, got {}")
    for name, head_task in task.items():
        check_name(name, "task: head")  # (it names keys and the report's files)
        if head_task not in TASKS:
            raise ConfigError(
                f"task: head {name!r} needs one of {', '.join(TASKS)}, got {head_task!r}"
            )
    return "custom", {str(name): head_task for name, head_task in task.items()}


def head_of(value: Any, name: str, index: int) -> Any:
    """A head's part of a model's output or of a target: a dict's (or a Hugging Face
    output's) by the head's name, a tuple's or list's by its place in the task mapping.

    >>> head_of({"kind": 1, "size": 2}, "size", 1), head_of((1, 2), "size", 1)
    (2, 2)
    """
    if isinstance(value, Mapping):
        if name in value:
            return value[name]
    elif isinstance(value, (tuple, list)):
        if index < len(value):
            return value[index]
    elif hasattr(value, name):
        return getattr(value, name)
    raise ModelError(
        f"model: no head {name!r} in a {type(value).__name__}: with a task per head the "
        "model returns a dict of its heads (or a tuple in the task mapping's order), and "
        "the target is one too"
    )


def reduction_of(loss_fn: Any, given: str = "auto") -> str:
    """How ``loss_fn`` reduces a batch: ``"mean"`` or ``"sum"``; ``given``, or for
    ``"auto"`` the ``reduction`` a torch loss module carries, else ``"mean"``. A sum (the
    VAE of pytorch/examples) is reported per sample and weighted as a sum under accumulation.

    >>> reduction_of(nn.MSELoss(reduction="sum")), reduction_of(F.mse_loss)
    ('sum', 'mean')
    """
    if given not in ("auto", "mean", "sum"):
        raise ConfigError(f"loss_reduction must be 'auto', 'mean' or 'sum'; got {given!r}")
    found = getattr(loss_fn, "reduction", "mean") if given == "auto" else given
    return found if found in ("mean", "sum") else "mean"


def takes_probabilities(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` takes probabilities (``BCELoss``: the model ends in a sigmoid), so
    the outputs are probabilities already: decided at 0.5 and never put through a sigmoid.

    >>> takes_probabilities(nn.BCELoss()), takes_probabilities(nn.BCEWithLogitsLoss())
    (True, False)
    """
    return isinstance(loss_fn, nn.BCELoss) or loss_fn is F.binary_cross_entropy


# What a model's outputs are: "auto" (probabilities when the loss takes them or the model
# ends in a sigmoid or softmax module), "logits" (scores: put through a sigmoid or softmax
# for predictions) or "probabilities" (returned as they are, labels decided at 0.5).
OUTPUTS = ("auto", "logits", "probabilities")


def outputs_are_probabilities(outputs: str, model: nn.Module | None, loss_fn: Any) -> bool:
    """Whether the model's outputs are probabilities already, so that ``predict`` never puts
    them through a second sigmoid or softmax (0.42 became 0.60: every pair "same") and a
    label is decided at 0.5: ``outputs="probabilities"``, or ``"auto"`` and a loss that
    takes probabilities or a model whose last module is an ``nn.Sigmoid`` or ``nn.Softmax``.

    >>> outputs_are_probabilities("auto", nn.Sequential(nn.Linear(2, 1), nn.Sigmoid()), None)
    True
    """
    if outputs not in OUTPUTS:
        raise ConfigError(f"outputs must be one of {', '.join(OUTPUTS)}; got {outputs!r}")
    if outputs != "auto":
        return outputs == "probabilities"
    modules = model.modules() if model is not None else ()
    leaves = [m for m in modules if next(m.children(), None) is None]  # (the last: its last layer)
    last_is_activation = bool(leaves) and isinstance(leaves[-1], (nn.Sigmoid, nn.Softmax))
    return takes_probabilities(loss_fn) or last_is_activation


def predicted_task(task: str, loss_fn: Any, evaluated: Mapping[str, Any] | None) -> str:
    """The task ``predict`` follows: ``task``, except that ``"auto"`` with a loss function of
    the user's (one that implies no task) is ``"custom"``, the outputs as they are, said once,
    unless the last evaluation (``evaluated``) found integer labels that fit the outputs and
    reported an accuracy: such a loss says nothing about the outputs (a VAE's 784 pixels are
    no classes to softmax), the labels do."""
    if task != "auto" or loss_fn is None or (evaluated is not None and "accuracy" in evaluated):
        return task
    warnings.warn(
        "predict: the loss implies no task (task 'auto'), so the outputs are returned as they "
        "are; set task='classification' (or 'multilabel') for probabilities",
        stacklevel=3,
    )
    return "custom"


# Set by glassloop.load_model on the model it returns: the task its weights file names, so
# that glassloop.predict(model, x) returns what that task means without being told again.
TASK_ATTRIBUTE = "glassloop_task"


def task_of(model: Any, task: str) -> str:
    """``task``, or for ``"auto"`` the task recorded on a model :func:`glassloop.load_model`
    returned."""
    recorded = getattr(model, TASK_ATTRIBUTE, None)
    return recorded if task == "auto" and isinstance(recorded, str) else task


def prediction_of(output: Any, *, with_loss: bool = False) -> torch.Tensor:
    """The prediction part of a model's ``output`` (the rule in this module's docstring);
    ``with_loss``: the model computed its own loss in this call.

    >>> prediction_of({"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3)}).shape
    torch.Size([2, 3])
    """
    if isinstance(output, torch.Tensor):
        return output
    found: Any = None
    if isinstance(output, Mapping):
        if "logits" in output:
            found = output["logits"]
        else:
            found = next(
                (v for k, v in output.items() if k != "loss" and isinstance(v, torch.Tensor)),
                None,
            )
    elif isinstance(output, (tuple, list)):
        index = 1 if with_loss else 0
        found = output[index] if len(output) > index else None
    elif hasattr(output, "logits"):
        found = output.logits
    if not isinstance(found, torch.Tensor):
        raise ModelError(
            f"model: cannot find the prediction in an output of type {type(output).__name__}: "
            "return a tensor, a dict with 'logits', or a tuple whose first element is the "
            "prediction"
        )
    return found


def model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself (``loss_fn=None``): ``output["loss"]``,
    ``output.loss`` or ``output[0]``."""
    loss: Any = None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise ModelError(
            f"model: loss_fn is None, so the model must compute its loss, but its output "
            f"({type(output).__name__}) has no scalar 'loss' (pass the target as labels= "
            "and return {'loss': ..., 'logits': ...}, or give a loss_fn)"
        )
    return loss


def activate(
    task: str, prediction: torch.Tensor, classes: int | None = None, *, probabilities: bool = False
) -> torch.Tensor:
    """What ``predict`` returns for ``task``: class probabilities (softmax over the classes,
    returned in the last dimension), label probabilities (sigmoid), or the outputs as they
    are; in float32. Outputs that are ``probabilities`` already are returned as they are. Classes
    are the last dimension, or dimension 1 (torch's ``(N, C, T)`` layout) when ``classes``
    says the last one is not them. A single column is never put through a softmax.

    >>> activate("auto", torch.tensor([[2.0], [-1.0]])).flatten().tolist()
    [2.0, -1.0]
    """
    prediction = prediction.float()
    if task in LABEL_TASKS:
        layout_n_c_t = prediction.ndim > 2 and prediction.shape[-1] != classes
        if classes is not None and layout_n_c_t and prediction.shape[1] == classes:
            prediction = prediction.movedim(1, -1)
        if probabilities:  # (a model ending in a softmax: never a second one)
            return prediction
        if prediction.ndim < 2 or prediction.shape[-1] < 2:
            return single_column(task, prediction)
        return torch.softmax(prediction, dim=-1)
    if task == "multilabel":
        return prediction if probabilities else torch.sigmoid(prediction)
    return prediction


def single_column(task: str, prediction: torch.Tensor) -> torch.Tensor:
    """A softmax over one column is 1.0 whatever the model says: a classification needs an
    output per class; ``"auto"`` returns the column as it is and says so (once)."""
    if task != "auto":
        raise ModelError(
            f"model: task {task!r} needs one output per class, but the model returns one "
            "column (a softmax over it is always 1.0): give it an output per class, or for a "
            "yes/no or a value set task='multilabel' (BCEWithLogitsLoss) or 'regression'"
        )
    warnings.warn(
        "predict: the model returns one column and its task is 'auto' (the loss implies no "
        "task): returning the outputs as they are, not a softmax (always 1.0 over one "
        "column); set task='multilabel' for sigmoid probabilities or 'regression'",
        stacklevel=3,
    )
    return prediction


def class_scores(prediction: torch.Tensor, target: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Class scores as ``(M, C)`` and labels as ``(M,)`` for a classification batch, per
    sample (``(N, C)`` with ``(N,)``) or per token (``(N, T, C)`` with ``(N, T)``, or torch's
    ``(N, C, T)``); ``None`` when the target is not integer labels that fit, or when there is
    one column (an argmax over it is always class 0)."""
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None
    if target.dtype == torch.bool or prediction.ndim != target.ndim + 1 or prediction.ndim < 2:
        return None
    found = None
    if prediction.ndim == 2:
        found = prediction, target
    elif prediction.shape[:-1] == target.shape:  # classes last: (N, T, C)
        found = prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1)
    elif prediction.shape[0] == target.shape[0] and prediction.shape[2:] == target.shape[1:]:
        moved = prediction.movedim(1, -1)  # torch's (N, C, d1, ...) layout
        found = moved.reshape(-1, moved.shape[-1]), target.reshape(-1)
    return found if found is not None and found[0].shape[-1] >= 2 else None


def check_train_accuracy(wanted: bool, task: str, loss_fn: Any) -> bool:
    """``train_accuracy`` where it has a meaning: class labels (a classifier's, a language
    model's tokens) and a loss function that gets them (a model computing its own loss shifts
    them its way); one line otherwise."""
    if wanted and (task not in LABEL_TASKS or loss_fn is None):
        why = f"this run's task is {task!r}" if loss_fn is not None else "the model's own loss"
        raise ConfigError(
            f"train_accuracy counts a classifier's labels with a loss function; {why}: "
            "leave it off (the validation metrics still say how the model does)"
        )
    return bool(wanted)


def correct_labels(output: Any, target: Any, ignore_index: int = -100) -> torch.Tensor:
    """``[correct, counted]`` labels of a training batch (on the device, no host read; labels
    equal to ``ignore_index`` left out; ``[0, 0]`` when its target is not class labels, e.g.
    soft targets): the running ``train_accuracy``.

    >>> correct_labels(torch.eye(3), torch.tensor([0, 2, -100])).tolist()
    [1, 2]
    >>> correct_labels(torch.eye(3), torch.tensor([0, 1, 0]), ignore_index=0).tolist()
    [1, 1]
    """
    prediction = prediction_of(output)
    found = class_scores(prediction, target)
    if found is None:
        return torch.zeros(2, dtype=torch.int64, device=prediction.device)
    scores, labels = found
    kept = labels != ignore_index
    right = scores.detach().argmax(dim=-1) == labels
    if ignore_index >= 0:  # (a negative one, -100, is never a predicted class: no mask)
        right &= kept
    return torch.stack((right, kept)).sum(dim=1)  # (one sum for both: ~2 us less a step)


def check_same_shape(prediction: torch.Tensor, target: Any, where: str) -> None:
    """A regression's outputs and targets must have one shape: torch broadcasts ``(N, 1)``
    against ``(N,)`` to ``(N, N)`` and trains on the wrong loss without an error."""
    if isinstance(target, torch.Tensor) and prediction.shape != target.shape:
        raise DataError(
            f"data: {where}: the model's output has shape {tuple(prediction.shape)} and the "
            f"target {tuple(target.shape)}; a regression needs the same shape (torch would "
            "broadcast them and compare every output with every target): reshape the target "
            "(e.g. y.unsqueeze(1)) or the output (out.squeeze(1))"
        )


def own_shift(
    loss: torch.Tensor, prediction: torch.Tensor, target: Any, ignore_index: int
) -> int | None:
    """How a model that computed its own loss lines its per-token predictions up with the
    labels: ``0`` (position t predicts label t), ``1`` (Hugging Face causal LMs shift inside:
    position t predicts label t+1), found by recomputing its loss both ways; ``None`` when
    neither gives the model's loss, so token metrics cannot be computed as the model counts
    them and are not reported (comparing unshifted labels gave an accuracy that never moved
    while the loss fell). Per-sample predictions are taken as they are (``0``)."""
    per_token = (
        isinstance(target, torch.Tensor)
        and not target.is_floating_point()
        and target.ndim == 2
        and prediction.ndim == 3
        and prediction.shape[:2] == target.shape
    )
    if not per_token:
        return 0
    for shift in (0, 1):
        scores = prediction[:, : prediction.shape[1] - shift].reshape(-1, prediction.shape[-1])
        labels = target[:, shift:].reshape(-1)
        recomputed = F.cross_entropy(scores.float(), labels, ignore_index=ignore_index)
        if torch.isclose(recomputed, loss.detach().float(), rtol=1e-3, atol=1e-5):
            return shift
    warnings.warn(
        "evaluate: the model's own loss is not the cross-entropy of its logits with the "
        "labels as given, nor shifted by one token; token accuracy is not reported (only "
        "the model's loss)",
        stacklevel=3,
    )
    return None
