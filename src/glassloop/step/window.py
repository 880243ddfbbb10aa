"""One optimizer step's micro-batches and each one's share of its loss: a :class:`Window`,
what ``train_step`` receives. The shares make the summed gradients those of one big batch
(samples or tokens, over every process), also in an epoch's last, shorter window.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from glassloop.batch import Inputs, batch_size_of
from glassloop.distributed.world import World, agreed_counts
from glassloop.precision import autocast
from glassloop.tasks import model_loss, own_shift, prediction_of

# What a train_step returns: the step's loss, named losses, or None (skipped).
StepLoss = torch.Tensor | Mapping[str, torch.Tensor] | None


class Windows:
    """How the loop makes each step's :class:`Window`: weighted by samples, or by tokens
    (``loss_weighting="tokens"`` with a mean loss: the labels other than ``ignore_index``;
    a model's own loss counts them from a shift found once, :func:`label_shift`), and only
    when there is something to weigh (several micro-batches or processes)."""

    def __init__(
        self,
        model: nn.Module,
        world: World,
        summed: bool,
        tokens: bool,
        ignore_index: int,
        own_loss: bool,
        *,
        precision: str = "32",
        device: torch.device | None = None,
    ) -> None:
        self.model, self.world, self.summed, self.tokens = model, world, summed, tokens
        self.ignore_index, self.own_loss = ignore_index, own_loss
        self.precision, self.device = precision, device or torch.device("cpu")
        self.shift: int | None = None  # tokens a model's own loss counts: from t+shift
        self.distributed = world.distributed  # (read every step: an attribute, no call)

    def make(
        self, micro: list[tuple[Inputs, Any]], received: int | None, rows: int | None = None
    ) -> tuple[Window, int | None]:
        """The step's :class:`Window` (each micro-batch's loss weight, ``None`` alone in one
        process: the loss as it is) and under DDP the stop signal any process ``received``,
        in one collective. Weighted by tokens (labels other than ``ignore_index``, from the
        model's shift on) or by samples; ``summed``: a loss that adds up over a batch;
        ``rows``: each batch split into micro-batches of at most that many rows first."""
        if rows is not None:  # (micro_batch_size)
            micro = [part for batch in micro for part in split_rows(batch, rows)]
        if len(micro) == 1 and not self.distributed:  # alone: the loss as it is (the default)
            ((inputs, target),) = micro
            samples = batch_size_of(target, inputs)
            return Window(micro, [None], samples, samples), None
        counts = [batch_size_of(target, inputs) for inputs, target in micro]
        local = samples = sum(counts)
        if self.tokens:
            if self.shift is None and self.own_loss:  # HF causal LMs: by one
                inputs, target = micro[0]
                shown = (self.ignore_index, self.device, self.precision)
                self.shift = label_shift(self.model, inputs, target, *shown)
            counts = token_counts([t for _, t in micro], self.shift or 0, self.ignore_index)
            micro, counts = without_empty(micro, counts)  # (padding alone: a mean of 0/0)
        total, signum = sum(counts), None
        if self.distributed:  # the counts of every process, and a stop signal of any
            total, samples, signum = agreed_counts(total, samples, received)
        weights = loss_weights(counts, total, self.world.size, summing=self.summed)
        return Window(micro, list(weights), samples, local), signum


def split_rows(micro: tuple[Inputs, Any], rows: int) -> list[tuple[Inputs, Any]]:
    """``micro`` as micro-batches of at most ``rows`` rows: every tensor whose first dimension
    is the batch's is sliced along it (views, no copy); anything else goes to each as is.

    >>> x, y = torch.arange(10).view(5, 2), torch.arange(5)
    >>> [t.tolist() for (_, _), t in split_rows((((x,), {}), y), 2)]
    [[0, 1], [2, 3], [4]]
    """
    inputs, target = micro
    size = batch_size_of(target, inputs)
    if size <= rows:
        return [micro]
    return [
        apply_to_collection(
            micro, torch.Tensor, lambda t, a=start: t[a : a + rows] if _rows(t, size) else t
        )
        for start in range(0, size, rows)
    ]


def _rows(tensor: torch.Tensor, size: int) -> bool:
    return tensor.ndim > 0 and tensor.shape[0] == size


@dataclass(slots=True)
class Window(Sequence[tuple[Inputs, Any]]):
    """The micro-batches of one optimizer step, as ``train_step`` receives them; a sequence of
    ``(inputs, target)`` pairs (``inputs`` is ``(args, kwargs)``) that also carries what the
    loop computed about them."""

    batches: list[tuple[Inputs, Any]]
    weights: list[float | None]  # each micro-batch's share of the step's loss (None: as is)
    samples: int  # samples in the window, over every process
    local: int  # this process's samples in it

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: Any) -> Any:
        return self.batches[index]

    def __iter__(self) -> Iterator[tuple[Inputs, Any]]:  # (Sequence's own calls __getitem__)
        return iter(self.batches)


def loss_weights(
    counts: Sequence[int], total: int, processes: int, *, summing: bool
) -> list[float]:
    """Each micro-batch's loss weight in an accumulation window: its samples (or tokens) over
    the window's ``total`` across all processes, times ``processes`` (DDP averages gradients
    over processes: this makes the average sample-weighted); a summing loss gets
    ``processes`` alone (sums of micro-batches add up to one big batch's sum).

    >>> loss_weights([3, 1], 4, 1, summing=False), loss_weights([3, 1], 8, 2, summing=True)
    ([0.75, 0.25], [2.0, 2.0])
    """
    if summing:
        return [float(processes)] * len(counts)
    return [processes * count / total if total else 0.0 for count in counts]


def token_counts(targets: Sequence[torch.Tensor], shift: int, ignore_index: int) -> list[int]:
    """How many tokens each target's loss averages over: labels other than ``ignore_index``,
    from position ``shift`` on (a model that shifts its labels itself, e.g. a causal LM's).

    >>> token_counts([torch.tensor([[5, -100, 7]])], 1, -100)
    [1]
    """
    labels = [t[:, shift:] if shift else t for t in targets]
    return [int((t != ignore_index).sum()) for t in labels]


def without_empty(micro: list[Any], counts: list[int]) -> tuple[list[Any], list[int]]:
    """The micro-batches (and their token counts) that hold a token to count, unless none
    does: one that is padding alone has a token mean of 0/0, NaN in every gradient even at
    weight 0 (a split batch's all-padded rows, an accumulation window's padded batch).

    >>> without_empty(["a", "b", "c"], [3, 0, 2])
    (['a', 'c'], [3, 2])
    """
    if 0 not in counts or not any(counts):
        return micro, counts
    kept = [i for i, count in enumerate(counts) if count]
    return [micro[i] for i in kept], [counts[i] for i in kept]


def label_shift(
    model: nn.Module,
    inputs: Any,
    target: Any,
    ignore_index: int,
    device: torch.device,
    precision: str = "32",
) -> int:
    """:func:`own_shift` of a model that computes its own loss, from one forward of a batch
    in eval mode without gradients (no dropout: no random number is drawn), under
    ``precision``'s autocast; ``0`` when it is not found. The loop's ``loss_weighting=
    "tokens"`` counts the tokens such a loss averages over with it."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(precision, device):
            output = model(*inputs[0], **inputs[1])
    finally:
        model.train(was_training)
    shift = own_shift(
        model_loss(output), prediction_of(output, with_loss=True), target, ignore_index
    )
    return shift or 0
