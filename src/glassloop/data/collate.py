"""Dynamic padding: pad variable-length sequences to the longest in the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence


def pad_collate(
    samples: Sequence[Any], *, pad_value: int = 0, label_pad_value: int = -100
) -> dict[str, torch.Tensor]:
    """Collate ``(sequence, label)`` pairs or dicts with ``input_ids`` (and ``labels``) into
    ``input_ids [B, L]`` padded with ``pad_value`` to the batch's longest sequence,
    ``attention_mask [B, L]`` (1 for real tokens), ``lengths [B]`` and ``labels``: stacked
    when they are per-sequence, padded with ``label_pad_value`` (CrossEntropyLoss's
    ``ignore_index``) when they are per-token.

    >>> batch = pad_collate([(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)])
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]], [1, 0])
    """
    if not samples:
        raise ValueError("pad_collate: empty batch")
    sequences, labels = [], []
    for sample in samples:
        if isinstance(sample, Mapping):  # (a tokenizer's BatchEncoding too)
            sequences.append(torch.as_tensor(sample["input_ids"]))
            labels.append(sample.get("labels", sample.get("label")))
        else:
            sequence, label = sample
            sequences.append(torch.as_tensor(sequence))
            labels.append(label)
    lengths = torch.tensor([len(s) for s in sequences])
    input_ids = pad_sequence(sequences, batch_first=True, padding_value=pad_value)
    longest = input_ids.shape[1]
    mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    batch = {"input_ids": input_ids, "attention_mask": mask, "lengths": lengths}
    if labels[0] is None:
        return batch
    label_tensors = [torch.as_tensor(label) for label in labels]
    if label_tensors[0].ndim == 0:
        batch["labels"] = torch.stack(label_tensors)
    else:  # per token: padded to the inputs' length
        padded = pad_sequence(label_tensors, batch_first=True, padding_value=label_pad_value)
        batch["labels"] = F.pad(padded, (0, longest - padded.shape[1]), value=label_pad_value)
    return batch


def padding_fraction(batches: Sequence[dict[str, torch.Tensor]]) -> float:
    """Share of padded positions over all positions in ``batches`` (0 = no padding)."""
    total = sum(int(b["attention_mask"].numel()) for b in batches)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    return 1.0 - real / total if total else 0.0
