"""evaluate() and predict(): eval mode, no gradients, averages over samples."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from glassloop.batch import split_batch, split_inputs
from glassloop.device import move_to_device
from glassloop.distributed import distributed_job
from glassloop.metrics import ClassificationSums, is_class_labels

LossFn = Callable[..., torch.Tensor]


def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    loss_fn: LossFn,
    *,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Return ``loss`` (mean over samples) and, for classifiers, ``accuracy``, ``confusion``
    (rows true, columns predicted) and ``report`` (per-class precision/recall/F1/support).

    The tutorial averages batch means (``test_loss / num_batches``), which over-weights a
    short last batch; here every sample counts once. Inside a multi-process job each process
    evaluates its own shard and the sums are added across processes.

    >>> model = nn.Linear(4, 3)
    >>> data = [(torch.zeros(5, 4), torch.tensor([0, 1, 2, 0, 1]))]
    >>> sorted(evaluate(model, data, nn.CrossEntropyLoss()))
    ['accuracy', 'confusion', 'loss', 'report']
    """
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()  # dropout off, batch-norm uses its running statistics
    sums: ClassificationSums | None = None
    try:
        with torch.no_grad():
            for batch in loader:
                (args, kwargs), target = split_batch(move_to_device(batch, device))
                output = model(*args, **kwargs)
                loss = loss_fn(output, target)
                if sums is None:
                    classes = int(output.shape[1]) if is_class_labels(output, target) else None
                    sums = ClassificationSums(classes, device)
                sums.update(loss, output, target)
    finally:
        model.train(was_training)
    if sums is None:
        return ClassificationSums(None, device).compute()  # raises: empty
    if distributed_job():
        sums.all_reduce()  # each process saw its shard; report the whole validation set
    return sums.compute()


def predict(
    model: nn.Module,
    data: torch.Tensor | Iterable[Any],
    *,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Class probabilities (softmax over the last dimension) on the CPU, in input order.

    ``data`` is a tensor of inputs (split into batches of ``batch_size``) or an iterable of
    batches; a batch's target, if any, is ignored.

    >>> probs = predict(nn.Linear(4, 3), torch.zeros(2, 4))
    >>> probs.shape, bool(torch.allclose(probs.sum(1), torch.ones(2)))
    (torch.Size([2, 3]), True)
    """
    device = device if device is not None else next(model.parameters()).device
    batches: Iterable[Any] = (
        torch.split(data, batch_size) if isinstance(data, torch.Tensor) else data
    )
    was_training = model.training
    model.eval()
    outputs: list[torch.Tensor] = []
    try:
        with torch.inference_mode():
            for batch in batches:
                args, kwargs = split_inputs(move_to_device(batch, device))
                logits = model(*args, **kwargs)
                outputs.append(torch.softmax(logits.float(), dim=-1).cpu())
    finally:
        model.train(was_training)
    if not outputs:
        return torch.empty(0)
    return torch.cat(outputs)
