"""Text classification data: a CSV or JSONL of texts and labels → a tokenizer trained on the
training texts (Hugging Face ``tokenizers``, no downloads) or a supplied ``tokenizer.json`` →
variable-length token ids, batched with dynamic padding (:func:`pad_collate`: to the longest
sequence of each batch) and length buckets."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from glassloop.data.options import DataConfig
from glassloop.data.raw_files import reading_text
from glassloop.data.splits import stratified_split
from glassloop.errors import DataError

PAD, UNK = "[PAD]", "[UNK]"


class TextDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token id sequences (1-D tensors of varying length) and their class labels."""

    def __init__(self, ids: list[torch.Tensor], labels: torch.Tensor) -> None:
        self.ids = ids
        self.labels = labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.labels[i]

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.ids]


class TextRows(Protocol):
    """A set of texts as token ids: in memory (:class:`TextDataset`) or read from disk
    (:class:`glassloop.data.shards.ShardRows`)."""

    labels: torch.Tensor

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @property
    def lengths(self) -> list[int] | None: ...  # (None: no length buckets)


@dataclass
class TextData:
    """Training and validation sets plus what the model and prediction need."""

    train: TextRows
    val: TextRows
    vocab_size: int
    pad_id: int
    num_classes: int
    class_names: list[str]
    tokenizer_json: str
    max_length: int

    @property
    def y_val(self) -> torch.Tensor:
        return self.val.labels

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.max_length,)

    @property
    def preprocessing(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer_json, "max_length": self.max_length}


def read_texts(path: Path, text_column: str, label_column: str) -> tuple[list[str], list[str]]:
    """Texts and labels from a CSV with a header or a JSONL file (one object per line)."""
    with reading_text(path):
        records = _records(path)
    if not records:
        raise DataError(f"data: '{path}' holds no texts")
    for column in (text_column, label_column):
        if column not in records[0]:
            raise DataError(
                f"data: '{path}' has no column {column!r}; it has {', '.join(records[0])} "
                "(set data.text_column / data.label_column)"
            )
    return [str(r[text_column]) for r in records], [str(r[label_column]) for r in records]


def _records(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    if path.suffix in (".jsonl", ".json"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"data: '{path}' line {number} is not JSON: {err}") from err
    else:
        with path.open(newline="", encoding="utf-8") as handle:
            records = list(csv.DictReader(handle))
    return records


def train_tokenizer(texts: Iterable[str] | Iterable[list[str]], vocab_size: int) -> Any:
    """A lower-casing BPE tokenizer learnt from ``texts`` (the training split only; strings,
    or lists of them: one pass, so an iterator streamed from disk works)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, UNK])
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_for(path: str, texts: Iterable[str] | Iterable[list[str]], vocab_size: int) -> str:
    """The tokenizer (as JSON) in ``path``, or, without one, one trained on ``texts``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            "data: text columns need the tokenizers package: pip install 'glassloop[text]'"
        ) from None
    if path:
        if not Path(path).is_file():
            raise DataError(f"data: tokenizer '{path}' not found (data.tokenizer)")
        try:
            return str(Tokenizer.from_file(path).to_str())
        except Exception as err:  # the tokenizers library raises a bare Exception
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"data: '{path}' is not a tokenizer file (data.tokenizer: a tokenizer.json "
                f"saved by the tokenizers library): {detail}"
            ) from err
    return str(train_tokenizer(texts, vocab_size).to_str())


def load_text(cfg: DataConfig) -> TextData:
    if not cfg.path:
        raise DataError("data: data.name = 'text-csv' needs data.path = 'texts.csv' (or .jsonl)")
    path = Path(cfg.path)
    if not path.is_file():
        raise DataError(f"data: '{path}' not found (data.path)")
    texts, raw_labels = read_texts(path, cfg.text_column, cfg.label_column)
    names = sorted(set(raw_labels))
    labels = np.array([names.index(v) for v in raw_labels], dtype=np.int64)
    order = np.arange(len(texts))
    train_idx, y_tr, val_idx, y_va = stratified_split(
        order, labels, val_size=cfg.val_fraction, seed=cfg.seed
    )
    training = [texts[i] for i in train_idx] if not cfg.tokenizer else []
    tokenizer_json = tokenizer_for(cfg.tokenizer, training, cfg.vocab_size)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    pad_id = tokenizer.token_to_id(PAD)
    pad_id = 0 if pad_id is None else int(pad_id)

    def encode(indices: np.ndarray) -> list[torch.Tensor]:
        encoded = tokenizer.encode_batch([texts[i] for i in indices])
        # An empty text still yields one (padding) token so every sequence has a length.
        return [
            torch.tensor((e.ids or [pad_id])[: cfg.max_length], dtype=torch.long) for e in encoded
        ]

    return TextData(
        TextDataset(encode(train_idx), torch.as_tensor(y_tr)),
        TextDataset(encode(val_idx), torch.as_tensor(y_va)),
        tokenizer.get_vocab_size(),
        pad_id,
        len(names),
        names,
        tokenizer.to_str(),
        cfg.max_length,
    )


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
