"""Hugging Face ``datasets`` as glassloop reads them: a ``Dataset`` or a streaming
``IterableDataset`` given to ``fit``, ``evaluate`` or ``predict`` (:func:`loader_for`), and
``data.name = "hf"``, a folder ``save_to_disk`` wrote or Parquet/Arrow files (:func:`hf_data`).

A ``Dataset`` is map-style: glassloop's :class:`~glassloop.data.loaders.ResumableLoader`
orders each epoch as a seeded permutation of all of it, shards it over processes and resumes
it by position, exactly. A streaming ``IterableDataset`` is read in its own order
(:class:`StreamedBatches`); its position is its own ``state_dict()``, so a resume reads only
what is left, exactly, unless it shuffles through a buffer: the buffer is not in that state
(Hugging Face refills it on resume: rows skipped, others read twice), and the resume says so.
``datasets`` is imported only by one who reads with it (a caller holding a dataset has).
"""

from __future__ import annotations

import glob
import inspect
import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from glassloop.batch import TARGET_KEYS
from glassloop.data.lazy import STATS_ROWS, DiskData, TableRows, check_values, input_kind, prepared
from glassloop.data.loaders import LoaderPosition, make_loader
from glassloop.data.splits import check_class_count, stratified_split
from glassloop.data.text import TextData
from glassloop.distributed.world import SINGLE, World, distributed_job, unwrap_model, world_from_env
from glassloop.errors import DataError

if TYPE_CHECKING:
    from glassloop.data.options import DataConfig
    from glassloop.state import TrainState

BATCH = 64  # rows per batch of a dataset given without a batch size (data.batch_size's default)


def hf_kind(data: Any) -> str | None:
    """``"map"`` for a Hugging Face ``Dataset``, ``"stream"`` for an ``IterableDataset``,
    else ``None`` (``datasets`` is not imported for it: whoever holds one has imported it)."""
    module = sys.modules.get("datasets")
    if module is None:
        return None
    if isinstance(data, module.Dataset):
        return "map"
    return "stream" if isinstance(data, module.IterableDataset) else None


class Fitting(Protocol):
    """What :func:`fit_loaders` reads of a Trainer."""

    model: nn.Module
    world: World
    state: TrainState
    options: dict[str, Any]
    console: Any  # (its message(): the columns left out, said once)
    _train_loader: Iterable[Any]


def fit_loaders(
    trainer: Fitting, train: Iterable[Any], val: Any, batch_size: int | None
) -> tuple[Iterable[Any], Any]:
    """``fit``'s training and validation sets, a Hugging Face dataset among them in
    glassloop's loader (:func:`loader_for`) of ``batch_size`` rows per process: the training
    set shuffled from the Trainer's ``seed`` (0 without one), where the Trainer is (``fit``
    again goes on as one ``fit`` would; a stream mid-epoch: its loader kept), the validation
    sets in order."""
    if batch_size is not None and not hf_kind(train):
        raise DataError(
            f"fit: batch_size is for a Hugging Face dataset; the {type(train).__name__} given "
            "makes its own batches: leave batch_size out"
        )
    state, previous = trainer.state, trainer._train_loader
    common: dict[str, Any] = {"model": trainer.model, "world": trainer.world}
    common["batch_size"] = batch_size or BATCH
    loader: Iterable[Any] = train
    if isinstance(previous, StreamedBatches) and previous.source is train:
        loader = previous
    elif hf_kind(train):
        seed, say = trainer.options.get("seed") or 0, trainer.console.message
        loader = loader_for(train, shuffle=True, seed=seed, shard="batches", say=say, **common)
        if isinstance(loader, LoaderPosition) and (state.epoch or state.batch_in_epoch):
            loader.load_state_dict({"epoch": state.epoch, "batches_consumed": state.batch_in_epoch})
        elif isinstance(loader, StreamedBatches):
            loader.epoch = state.epoch
    if isinstance(val, Mapping):
        return loader, {name: loader_for(each, **common) for name, each in val.items()}
    return loader, loader_for(val, **common)


def loader_for(
    data: Any,
    *,
    model: nn.Module,
    batch_size: int = BATCH,
    world: World | None = None,  # (None: the running job's, as evaluate() sums over it)
    shuffle: bool = False,
    seed: int = 0,
    shard: str = "strided",
    say: Any = None,
) -> Any:
    """A Hugging Face dataset's batches for ``model`` (anything else: ``data`` as it is).

    Each batch is a dict of the columns ``model`` takes (Hugging Face's Trainer's rule: the
    target, ``label``/``labels``, and the arguments its ``forward`` names; the others are
    left out, and ``say`` says which; a set of none of them is refused), each a tensor,
    sequences of several lengths padded (:func:`collate_rows`). A ``Dataset``: a
    :class:`~glassloop.data.loaders.ResumableLoader` (``shuffle``, ``seed``, ``world`` and
    ``shard`` as :func:`~glassloop.data.loaders.make_loader`'s); a streaming one:
    :class:`StreamedBatches`.

    >>> import datasets
    >>> rows = datasets.Dataset.from_dict(
    ...     {"x": [[0.0, 1.0]] * 3, "label": [0, 1, 0], "id": [7, 8, 9]})
    >>> loader_for(rows, model=nn.Linear(2, 2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    glassloop.errors.DataError: data: none of the dataset's columns (x, label, id) is an ...
    >>> class Net(nn.Linear):
    ...     def forward(self, x): return super().forward(x)
    >>> batch = next(iter(loader_for(rows, model=Net(2, 2), batch_size=2, say=print)))
    data: the dataset's column id is not an argument of Net.forward(x): left out
    >>> {name: tuple(value.shape) for name, value in batch.items()}
    {'x': (2, 2), 'label': (2,)}
    """
    kind, source = hf_kind(data), data
    if kind is None:
        return data
    world = world or (world_from_env() if distributed_job() else SINGLE)
    transformed = kind == "map" and data.format["type"] == "custom"  # (set_transform's own)
    if data.column_names is not None and not transformed:
        kept, left = model_columns(list(data.column_names), model)
        if left and say is not None:
            named = f"columns {', '.join(left)} are" if len(left) > 1 else f"column {left[0]} is"
            say(f"data: the dataset's {named} not an argument of {forward_of(model)}: left out")
        data = data.select_columns(kept).with_format("torch")
    if kind == "stream":
        return StreamedBatches(data, source=source, batch_size=batch_size, world=world, shard=shard)
    return make_loader(
        data,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        num_workers=0,  # (a batch is one Arrow take in this process, as Hugging Face's default)
        collate_fn=collate_rows,
        world=world,
        shard=shard,
    )


def forward_of(model: nn.Module) -> str:
    """``Net.forward(x, mask)``: what a message names."""
    named = ", ".join(_named_arguments(model) or ["..."])
    return f"{type(unwrap_model(model)).__name__}.forward({named})"


def _named_arguments(model: nn.Module) -> list[str]:
    try:
        parameters = inspect.signature(unwrap_model(model).forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def model_columns(columns: list[str], model: nn.Module) -> tuple[list[str], list[str]]:
    """The columns passed to ``model`` (the target first of :data:`~glassloop.batch.
    TARGET_KEYS` among them and those its ``forward`` names; every one for a ``forward`` that
    names none) and those left out; refused when no input is left."""
    named = _named_arguments(model)
    target = next((key for key in TARGET_KEYS if key in columns), None)
    if not named:
        return columns, []
    kept = [c for c in columns if c in named or c == target]
    if not [c for c in kept if c != target]:
        other = next((c for c in columns if c != target), "x")
        raise DataError(
            f"data: none of the dataset's columns ({', '.join(columns)}) is an argument of "
            f"{forward_of(model)}, which takes a batch's columns by name; rename the input "
            f"column to it: ds.rename_column({other!r}, {named[0]!r})"
        )
    return kept, [c for c in columns if c not in kept]


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Dict rows as one dict batch: each column's values stacked into a tensor; sequences of
    several lengths padded to the longest, ``labels`` with -100 (what a loss ignores), the
    others with 0 (an attention mask's "no token"); strings as a list.

    >>> collate_rows([{"ids": [5, 6], "labels": [1, 2]}, {"ids": [7], "labels": [3]}])
    {'ids': tensor([[5, 6],
            [7, 0]]), 'labels': tensor([[   1,    2],
            [   3, -100]])}
    """
    batch: dict[str, Any] = {}
    for key in rows[0]:
        try:
            values = [torch.as_tensor(row[key]) for row in rows]
        except (TypeError, ValueError, RuntimeError):
            batch[key] = [row[key] for row in rows]  # (strings)
            continue
        if len({v.shape for v in values}) == 1:
            batch[key] = torch.stack(values)
        else:
            pad = -100 if key in ("labels", "label") else 0
            batch[key] = pad_sequence(values, batch_first=True, padding_value=pad)
    return batch


class StreamedBatches:
    """A streaming ``IterableDataset`` in batches of ``batch_size`` rows per process, read in
    its order (its ``set_epoch`` told each epoch: a shuffle's seed). Each process reads the
    whole stream and takes its part of every global batch of ``batch_size`` x processes rows
    (``shard="batches"``: :class:`~glassloop.data.loaders.EpochSampler`'s rule, so any number
    of processes trains on the batches of one; ``"strided"``: every row, for evaluation).
    Its position: the epoch, the batches handed out, and the dataset's ``state_dict()``
    after the last of them."""

    def __init__(
        self, dataset: Any, *, source: Any, batch_size: int, world: World, shard: str
    ) -> None:
        self.dataset, self.source = dataset, source  # (source: as given, before the columns)
        self.batch_size, self.world, self.shard = batch_size, world, shard
        self.epoch, self.batches_consumed = 0, 0
        self.position: dict[str, Any] | None = None  # (None: the epoch's start)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        training = self.shard == "batches"  # (an evaluation reads it all, the same each time)
        self.dataset.set_epoch(self.epoch)
        self.dataset.load_state_dict(self.position if training else None)  # (what is left)
        rows, size, rank = iter(self.dataset), self.world.size, self.world.rank
        while chunk := list(itertools.islice(rows, self.batch_size * size)):
            each, extra = divmod(len(chunk), size)
            begin = rank * each + min(rank, extra)
            if not training:
                mine = chunk[rank::size]
            elif each == 0:
                break  # (fewer rows than processes: dropped, as every process steps alike)
            else:
                mine = chunk[begin : begin + each + (rank < extra)]
                self.position = self.dataset.state_dict()  # (after the global batch's rows)
                self.batches_consumed += 1
            if mine:
                yield collate_rows(mine)
        if training:
            self.epoch += 1
            self.batches_consumed, self.position = 0, None

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "position": self.position,
            "global_batch": self.batch_size * self.world.size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.batches_consumed = int(state["epoch"]), int(state["batches_consumed"])
        self.position = state.get("position")
        run_batch = int(state.get("global_batch", self.batch_size * self.world.size))
        if run_batch % self.world.size == 0:  # (another number of processes: the run's batch)
            self.batch_size = run_batch // self.world.size

    def finish_epoch(self) -> None:
        """An epoch cut short (``limit_batches``): the next one starts at its beginning."""
        if self.batches_consumed:
            self.epoch += 1
            self.batches_consumed, self.position = 0, None

    def resume_caveat(self, batches: int) -> str | None:
        """What a resume ``batches`` into an epoch does not restore (``None``: nothing)."""
        node, buffer = getattr(self.dataset, "_ex_iterable", None), 0
        while node is not None and not buffer:  # (Hugging Face's chain of iterables)
            buffer, node = getattr(node, "buffer_size", 0), getattr(node, "ex_iterable", None)
        if not batches or not buffer:
            return None
        return (
            f"warning: the streamed dataset shuffles through a buffer of {buffer} rows, which "
            f"its state_dict() does not hold: resumed {batches} batches into epoch "
            f"{self.epoch + 1}, the rest of the epoch is not the uninterrupted run's (rows the "
            "buffer held skipped, others read twice, another order); exact: a map-style "
            "Dataset, which glassloop shuffles whole, or a stream without a shuffle buffer"
        )


def hf_data(d: DataConfig) -> DiskData | TextData:
    """``data.name = "hf"``: the rows of ``data.path`` (a folder ``save_to_disk`` wrote, of a
    ``Dataset`` or a ``DatasetDict``; Parquet or Arrow files: one, a folder, a glob) as the
    Parquet reader makes them: ``(inputs, class)``, the inputs ``data.image_column``'s
    images, ``data.text_column``'s tokens or every numeric column but ``data.label_column``.
    Validation rows: ``data.val_path``'s, a ``validation`` split, or a stratified
    ``data.val_fraction`` of the training rows (a ``test`` split is left alone)."""
    train, val = _splits(d)
    where, label = f"'{d.path}'", d.label_column
    kind, inputs = input_kind(train.data.schema, where, label, d.image_column, d.text_column)
    if missing := [c for c in (*inputs, label) for s in (train, val) if c not in s.column_names]:
        raise DataError(
            f"data: {where} has no column {missing[0]!r} in each split (data.label_column, "
            f"data.image_column, data.text_column); its columns: {', '.join(train.column_names)}"
        )
    classes, labels = _classes((train, val), label, where)
    if kind == "numeric":
        for column in inputs:  # (every row, as the Parquet reader checks each row group)
            check_values(train.data.column(column), column, where)
    rows = [HFRows(each, kind, inputs, y) for each, y in zip((train, val), labels, strict=True)]
    sample = train.select(range(min(STATS_ROWS, len(train)))).with_format("arrow")[:]
    return prepared(d, (rows[0], rows[1]), sample.select(inputs), classes)


class HFRows(TableRows):
    """A Hugging Face ``Dataset``'s rows as ``(inputs, class)`` (:func:`hf_data`), a batch's
    read as one Arrow ``take``."""

    def __init__(self, data: Any, kind: str, columns: list[str], labels: torch.Tensor) -> None:
        super().__init__(kind, columns)
        self.data, self.labels = data.select_columns(columns).with_format("arrow"), labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.inputs(self.data[indices]), self.labels[indices], strict=True))


def _splits(d: DataConfig) -> tuple[Any, Any]:
    """The training and validation sets of ``data.path`` (and ``data.val_path``)."""
    if not d.path:
        raise DataError("data: data.name = 'hf' needs data.path (a saved dataset or data files)")
    sets = _load(d.path, "data.path")
    if "train" not in sets:
        raise DataError(f"data: '{d.path}' has no 'train' split; its splits: {', '.join(sets)}")
    train = sets["train"]
    if d.val_path:
        held = _load(d.val_path, "data.val_path")
        return train, held.get("validation", next(iter(held.values())))
    if "validation" in sets or d.label_column not in train.column_names:
        return train, sets.get("validation", train)  # (no label: hf_data says so)
    # glassloop's stratified split, its indices in memory (no cache file in the user's folder)
    labels = train.select_columns([d.label_column]).with_format("numpy")[:][d.label_column]
    kept, _, held_out, _ = stratified_split(
        np.arange(len(train)), labels, val_size=d.val_fraction, seed=d.seed
    )
    return train.select(kept, keep_in_memory=True), train.select(held_out, keep_in_memory=True)


def _load(path: str, key: str) -> dict[str, Any]:
    """The splits at ``path`` by name (data files: one, ``train``)."""
    import datasets  # type: ignore[import-untyped]

    folder = Path(path)
    if (folder / "dataset_dict.json").is_file() or (folder / "dataset_info.json").is_file():
        loaded = datasets.load_from_disk(path)
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    found = folder.iterdir() if folder.is_dir() else map(Path, glob.glob(path))
    files = sorted(str(f) for f in found if f.suffix in (".parquet", ".arrow"))
    if not files or len({Path(f).suffix for f in files}) > 1:
        raise DataError(
            f"data: {key} = '{path}' is no folder save_to_disk wrote and names no .parquet or "
            ".arrow files (of one kind); point it at one of those"
        )
    return dict(datasets.load_dataset(Path(files[0]).suffix[1:], data_files=files))


def _classes(sets: tuple[Any, ...], label: str, where: str) -> tuple[list[str], list[Any]]:
    """The class names (a ``ClassLabel``'s, integers ``0..max``, or the strings sorted) and
    each set's rows' class indices."""
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    columns = [each.select_columns([label]).with_format("arrow")[:].column(0) for each in sets]
    for column in columns:
        check_values(column, label, where, missing="labels")
    kind, names = columns[0].type, getattr(sets[0].features[label], "names", None)
    if names:
        classes = [str(n) for n in names]
    elif pa.types.is_integer(kind):
        if (low := min(pc.min(c).as_py() for c in columns)) < 0:
            raise DataError(f"data: {where} column {label!r}: labels must be >= 0 (found {low})")
        high, rows = max(pc.max(c).as_py() for c in columns), sum(map(len, columns))
        classes = [str(c) for c in range(check_class_count(high, rows, where))]
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        classes = sorted({v for c in columns for v in c.unique().to_pylist()})
        columns = [pc.index_in(c, value_set=pa.array(classes)) for c in columns]
    else:
        raise DataError(f"data: {where} column {label!r} holds {kind} values, not class labels")
    return classes, [torch.from_numpy(c.to_numpy().astype(np.int64)) for c in columns]
