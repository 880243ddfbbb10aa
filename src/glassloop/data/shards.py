"""Parquet shards where they live: one file, a folder, a glob or a URL prefix on any fsspec
store (``s3://bucket/train/``), streamed through a bounded local cache in an order that a
resume continues exactly, on any number of processes.

The unit is a Parquet **row group** (a shard holds one or more): read with pyarrow over
fsspec, checked (page checksums where the file has them, the columns' values), and written
decoded as an Arrow IPC file into this process's cache folder, which every loader worker
memory-maps: a row is one zero-copy slice away, where a compressed row group would be
decoded again for each row. The loader's sampler tells the :class:`ReadAhead` thread which
row groups the epoch reaches next; it fetches them into the cache up to ``data.cache_mb``
and deletes those the epoch has passed, so a data set many times the cache trains in it.

Each epoch's order is a function of ``(seed, epoch)`` alone: a seeded permutation of the row
groups, cut into windows of ``data.shuffle_window``, and a seeded permutation of the rows of
each window. No shuffle buffer (whose contents a resume loses, as Hugging Face's streaming
datasets do): the position is the loader's few integers (epoch, batches, global batch), the
global batches are the same slices of that order on any number of processes
(:class:`~glassloop.data.loaders.EpochSampler`'s rule), and a resume fetches from the window
its position is in: only what is left. The order is drawn a window at a time, never a
permutation of every row (a billion rows would be 8 GB of indices).

Shards are listed once, with each one's size and ETag (object stores) or modification time:
a shard that differs when a row group is read (rewritten, replaced, deleted mid-run) is
refused in one line naming it, never mixed into the run. Validation rows are ``data.val_path``
(its own shards) or a seeded share of each row group's rows; the training statistics
(features' mean and std, images' channel statistics) and the tokenizer come from the first
row groups' training rows.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import queue
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glassloop.data.lazy import STATS_ROWS, DiskData, TableRows, check_values, input_kind, prepared
from glassloop.data.loaders import EpochSampler, epoch_seed
from glassloop.data.options import DataConfig
from glassloop.data.splits import check_class_count
from glassloop.data.text import TextData
from glassloop.errors import DataError
from glassloop.storage.atomic import atomic_path, refuse_link
from glassloop.storage.file_names import is_url
from glassloop.storage.redaction import redact, remember_secrets

LABEL = "__label__"  # the class index column of a cached row group


@dataclass(frozen=True)
class Shard:
    """A Parquet file as listed: its name in the store, size and version tag (ETag, else the
    modification time): a shard found with another size or tag has changed under the run."""

    name: str
    size: int
    tag: str


def _tag(info: dict[str, Any]) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "created"):
        if (value := info.get(key)) is not None:  # (a time as a number: listings and info
            return str(value.timestamp() if hasattr(value, "timestamp") else value)  # differ)
    return ""


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError as err:
        raise DataError(
            "data: data.name = 'parquet' needs pyarrow: pip install 'glassloop[parquet]'"
        ) from err
    return pq


class ShardSet:
    """The shards at ``path``, their row groups, the columns read and this process's cache
    folder; pickled for a loader worker, it is these names and numbers (never data)."""

    def __init__(self, path: str, key: str, *, cache_mb: int, window: int) -> None:
        import fsspec

        _pyarrow()  # (a missing pyarrow: the line saying what to install)
        import pyarrow as pa

        if "ARROW_DEFAULT_MEMORY_POOL" not in os.environ:  # (unless one was chosen)
            # Arrow's mimalloc kept pages its reading threads freed (with _trim: the training
            # process 365 MiB at 20x the cache, the system allocator's 345). Set before a
            # loader worker is forked: theirs too.
            pa.set_memory_pool(pa.system_memory_pool())
        remember_secrets(path)
        self.path, self.shown, self.url = path, f"'{redact(path)}'", is_url(path)
        try:
            self._fs, root = fsspec.core.url_to_fs(path)
        except (ImportError, ValueError) as err:
            raise DataError(f"data: cannot open {self.shown}: {err}") from None
        self._pid = os.getpid()
        self.shards = _listed(self.fs, root, key, self.shown)
        with ThreadPoolExecutor(16) as pool:  # (one footer each: a request's latency apiece)
            self.footers = list(pool.map(self.footer, range(len(self.shards))))
        self.schema = self.footers[0].schema.to_arrow_schema()
        # (shard, row group, rows, decoded bytes) of every non-empty row group
        self.units = [
            (s, g, f.row_group(g).num_rows, f.row_group(g).total_byte_size)
            for s, f in enumerate(self.footers)
            for g in range(f.num_row_groups)
            if f.row_group(g).num_rows
        ]
        self.window, self.budget = window, cache_mb << 20
        self.columns: list[str] = []  # what a cached row group keeps (set by use())
        self.version = 0
        self.classes: list[str] = []
        self.folder = Path()
        self._tables: OrderedDict[int, Any] = OrderedDict()  # this process's mapped ones
        self._ahead: ReadAhead | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "footers": None, "_tables": OrderedDict(), "_ahead": None}
        return {**state, "_fs": None}

    @property
    def fs(self) -> Any:
        """The store's filesystem, this process's own: a loader worker forked from the
        training process makes its own (s3fs's event loop is not fork-safe)."""
        if self._fs is None or self._pid != os.getpid():
            import fsspec

            self._fs, self._pid = fsspec.core.url_to_fs(self.path)[0], os.getpid()
        return self._fs

    def use(self, columns: list[str], classes: list[str]) -> None:
        """Cache ``columns`` (the label last, as class indices into ``classes``), in a folder
        named for them and for every shard's name, size and tag: another data set, another
        version of one or another choice of columns never takes these files."""
        from glassloop.storage.cache import cache_dir

        self.columns, self.classes = columns, classes
        listing = "\n".join(f"{s.name} {s.size} {s.tag}" for s in self.shards)
        key = f"{listing}\n{columns}\n{classes}".encode()
        digest = hashlib.sha256(key).hexdigest()[:16]
        self.version = int(digest[:15], 16)  # (in a checkpoint: a resume reads this data set)
        # This process's own folder, removed when it exits; one a dead process left is removed
        # here (a file another process wrote is never read: no damaged leftover is taken).
        self.folder = refuse_link(cache_dir() / "shards") / f"{digest}-{os.getpid()}"
        for left in self.folder.parent.glob("*-*"):
            if re.fullmatch(r"[0-9a-f]{16}-[0-9]+", left.name) and not _alive(left.name):
                shutil.rmtree(refuse_link(left), ignore_errors=True)
        atexit.register(shutil.rmtree, self.folder, ignore_errors=True)

    def name(self, shard: int) -> str:
        name = self.shards[shard].name
        return redact(self.fs.unstrip_protocol(name)) if self.url else name

    @contextlib.contextmanager
    def opened(self, shard: int, span: int = 0) -> Iterator[Any]:
        """The shard as a file, checked to be the one listed; its first read fetches ``span``
        bytes at once (a row group's: one request). (s3fs reads it with If-Match on the ETag
        it found when opening: a replacement mid-read fails, never mixes.)"""
        listed = self.shards[shard]
        reads = {"cache_type": "readahead", "block_size": span} if span else {}
        try:
            with self.fs.open(listed.name, "rb", **reads) as handle:
                info = getattr(handle, "details", None) or self.fs.info(listed.name)
                if (int(info["size"]), _tag(info)) != (listed.size, listed.tag):
                    raise DataError(
                        f"data: shard '{self.name(shard)}' changed during the run (size or "
                        "version differs from when it was listed); a run reads one version of "
                        "its data: restore it, or start a new run"
                    )
                yield handle
        except DataError:
            raise
        except FileNotFoundError:
            raise DataError(
                f"data: shard '{self.name(shard)}' is gone (deleted since the run listed it); "
                "restore it, or start a new run"
            ) from None
        except Exception as err:  # OSError, and a driver's own (botocore, aiohttp, ...)
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(f"data: cannot read shard '{self.name(shard)}': {detail}") from None

    def footer(self, shard: int) -> Any:
        with self.opened(shard) as handle:
            try:
                return _pyarrow().ParquetFile(handle).metadata
            except Exception as err:  # pyarrow's own errors for what is not Parquet
                raise DataError(
                    f"data: '{self.name(shard)}' is not a readable Parquet file: {err}"
                ) from None

    def read(self, unit: int, columns: list[str]) -> Any:
        """Row group ``unit`` of its shard (``columns``), page checksums verified."""
        shard, group = self.units[unit][:2]
        footer = self.footers[shard] if self.footers is not None else self.footer(shard)
        chunks = footer.row_group(group)
        wanted = [footer.schema.to_arrow_schema().get_field_index(c) for c in columns]
        ranges = [_chunk_range(chunks.column(i)) for i in wanted]
        span = max(end for _, end in ranges) - min(start for start, _ in ranges)
        with self.opened(shard, span) as handle:  # (the footer known: columns read in order)
            try:
                parquet = _pyarrow().ParquetFile(
                    handle, metadata=footer, page_checksum_verification=True
                )
                # (in this thread: Arrow's own pool of threads kept what they decoded)
                return parquet.read_row_group(group, columns=columns, use_threads=False)
            except Exception as err:  # pyarrow's, the driver's: a damaged or missing group
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise DataError(
                    f"data: '{self.name(shard)}' row group {group} cannot be decoded or read "
                    f"({first})"
                ) from None

    def table(self, unit: int) -> Any:
        """Row group ``unit`` decoded, from the cache (fetched into it if it is not there)."""
        if unit in self._tables:
            self._tables.move_to_end(unit)
            return self._tables[unit]
        import pyarrow as pa

        path = self.fetch(unit)
        try:
            table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except FileNotFoundError:  # (evicted between the two: fetched again)
            table = pa.ipc.open_file(pa.memory_map(str(self.fetch(unit)))).read_all()
        self._tables[unit] = table
        while len(self._tables) > 2 * self.window:  # (a mapping outlives its file's deletion)
            self._tables.popitem(last=False)
        return table

    def fetch(self, unit: int) -> Path:
        """The cached file of row group ``unit``, written once by whichever of this process's
        readers gets its lock first (the read-ahead thread or a loader worker)."""
        import fcntl

        import pyarrow as pa

        path = refuse_link(self.folder / f"{unit:09d}.arrow")
        if path.is_file():
            return path
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with refuse_link(path.with_suffix(".claim")).open("a") as claim:
                fcntl.flock(claim, fcntl.LOCK_EX)
                if not path.is_file():
                    table = self.checked(unit, self.read(unit, self.columns))
                    with (
                        atomic_path(path) as tmp,
                        pa.OSFile(str(tmp), "wb") as sink,
                        pa.ipc.new_file(sink, table.schema) as out,
                    ):
                        out.write_table(table)
        except OSError as err:
            raise DataError(
                f"data: cannot write the cache of {self.shown} in '{self.folder}': "
                f"{err.strerror or err}; set GLASSLOOP_CACHE_DIR to a writable folder (or "
                "free space there, or lower data.cache_mb)"
            ) from err
        return path

    def checked(self, unit: int, table: Any) -> Any:
        """The row group with its labels as class indices and its inputs checked (numbers
        present and finite, texts UTF-8): one line naming the shard, group, column and row."""
        shard, group = self.units[unit][:2]
        where = f"'{self.name(shard)}' row group {group}"
        label = self.columns[-1]
        labels = table.column(label).to_pylist()
        for name in self.columns[:-1]:
            check_values(table.column(name), name, where)
        if any(v is None for v in labels):
            raise DataError(f"data: {where} column {label!r} has missing labels")
        index = {name: i for i, name in enumerate(self.classes)}
        try:
            classes = [index[str(v)] for v in labels]
        except KeyError as err:
            raise DataError(
                f"data: {where} column {label!r} has the label {err.args[0]!r}, not one of the "
                f"{len(index)} classes listed at the start"
            ) from None
        import pyarrow as pa

        return table.drop_columns([label]).append_column(LABEL, pa.array(classes, pa.int64()))

    def read_ahead(self) -> ReadAhead:
        if self._ahead is None:
            self._ahead = ReadAhead(self)
        return self._ahead


def _chunk_range(chunk: Any) -> tuple[int, int]:
    """Where a column chunk's bytes are in its file: from its dictionary page, if it has one."""
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    return int(start), int(start + chunk.total_compressed_size)


def _alive(folder: str) -> bool:
    """Whether the process whose id ends ``folder``'s name is running."""
    try:
        os.kill(int(folder.rsplit("-", 1)[1]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive)
        return True
    return True


def _listed(fs: Any, root: str, key: str, shown: str) -> list[Shard]:
    """The ``.parquet`` files at ``root``: the file, a glob's matches or a folder's (all
    levels), sorted by name, with their sizes and tags (one listing: no request per file)."""
    import glob

    try:
        if glob.has_magic(root):
            found = fs.glob(root, detail=True)
        elif fs.isdir(root):
            found = fs.find(root, detail=True)
        else:
            found = {root: fs.info(root)}
    except FileNotFoundError:
        found = {}
    except Exception as err:  # the driver's own: a bucket that refuses a listing
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data: cannot list {shown}: {detail}") from None
    shards = [
        Shard(name, int(info["size"]), _tag(info))
        for name, info in sorted(found.items())
        if name.endswith(".parquet") and info.get("type", "file") == "file"
    ]
    if not shards:
        raise DataError(
            f"data: no .parquet files at {shown} ({key}: a .parquet file, a folder of them, a "
            "glob like 'train/*.parquet' or a URL prefix like 's3://bucket/train/')"
        )
    return shards


class ReadAhead:
    """Threads of the training process fetching the row groups an epoch reaches next into
    the cache (eight at once: a store's latency is paid side by side), up to its budget, and
    deleting the ones behind. Their failures are dropped: the worker that needs that row
    group reads it itself and says what went wrong."""

    def __init__(self, shards: ShardSet, threads: int = 8) -> None:
        self.shards, self.generation = shards, 0
        self.todo: queue.Queue[tuple[int, int]] = queue.Queue()
        self.libc: Any = None  # glibc, once: what gives back a row group's freed pages
        with contextlib.suppress(OSError):
            self.libc = ctypes.CDLL("libc.so.6")
        for _ in range(threads):
            threading.Thread(target=self._run, name="glassloop-read-ahead", daemon=True).start()

    def reach(self, windows: list[np.ndarray], current: int) -> None:
        """The epoch is at window ``current`` of ``windows``: keep the one before, this one
        and as many after as the budget holds; delete every other cached row group."""
        units, size = self.shards.units, 0
        ahead: list[int] = []
        for w in range(current, len(windows)):
            more = [int(u) for u in windows[w]]
            size += sum(units[u][3] for u in more)
            if w > current and size > self.shards.budget:
                break
            ahead += more
        behind = [int(u) for u in windows[current - 1]] if current else []
        kept = {f"{u:09d}.arrow" for u in (*behind, *ahead)}
        for path in self.shards.folder.glob("*.arrow"):  # (our names only, never a link)
            if path.name not in kept and not path.is_symlink():
                path.unlink(missing_ok=True)
        self.generation += 1  # (what was asked before is no longer fetched)
        for unit in ahead:
            self.todo.put((self.generation, unit))

    def _run(self) -> None:
        while True:
            generation, unit = self.todo.get()
            if generation == self.generation:
                with contextlib.suppress(Exception):
                    self.shards.fetch(unit)
                # glibc keeps the pages each reading thread freed in its arena: the process
                # grew with the data read (350 -> 538 MiB at 20x the cache; trimmed: 345).
                if self.libc is not None:
                    self.libc.malloc_trim(0)


class ShardRows(TableRows):
    """The training (or validation) rows of a :class:`ShardSet`: ``counts[u]`` rows of row
    group ``u`` (``val`` of them held out with a seeded choice per row group when
    ``held_out`` is set), indexed ``0..len-1`` in row group order; ``labels``: the first
    rows' (what doctor looks at)."""

    def __init__(self, shards: ShardSet, *, validation: bool, held_out: float, seed: int) -> None:
        self.shards, self.validation, self.held_out, self.seed = shards, validation, held_out, seed
        rows = np.array([u[2] for u in shards.units], dtype=np.int64)
        val = np.rint(rows * held_out).astype(np.int64)
        self.counts = val if validation else rows - val
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        super().__init__("numeric", list(shards.columns[:-1]))
        self.labels = torch.zeros(0, dtype=torch.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def order_sampler(self, num_samples: int, **options: Any) -> ShardSampler:
        return ShardSampler(self, num_samples, **options)

    def rows_of(self, unit: int) -> np.ndarray:
        """The rows of row group ``unit`` this set takes, in file order."""
        n = self.shards.units[unit][2]
        if not self.held_out:
            return np.arange(n)
        generator = np.random.default_rng([self.seed, unit])
        chosen = generator.permutation(n)
        val = n - int(self.counts[unit]) if not self.validation else int(self.counts[unit])
        return np.sort(chosen[:val] if self.validation else chosen[val:])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch's rows, read a row group at a time (one ``take`` each)."""
        at = np.asarray(indices, dtype=np.int64)
        units = np.searchsorted(self.starts, at, side="right") - 1
        out: list[Any] = [None] * len(at)
        for unit in np.unique(units):
            where = np.flatnonzero(units == unit)
            rows = self.rows_of(int(unit))[at[where] - self.starts[unit]]
            part = self.shards.table(int(unit)).take(rows)
            labels = torch.from_numpy(part.column(LABEL).to_numpy().astype(np.int64))
            for i, x, y in zip(where, self.inputs(part), labels, strict=True):
                out[i] = (x, y)
        return out


class ShardSampler(EpochSampler):
    """:class:`EpochSampler`'s order, sharding and position over a :class:`ShardRows`, drawn
    a window at a time (see the module's docstring), telling the read-ahead where it is."""

    def __init__(self, rows: ShardRows, num_samples: int, **options: Any) -> None:
        super().__init__(num_samples, **options)
        self.rows = rows

    @property
    def version(self) -> dict[str, int]:
        return {"data_version": self.rows.shards.version}

    @property
    def shown(self) -> str:
        return self.rows.shards.shown

    def windows(self) -> list[np.ndarray]:
        units = np.flatnonzero(self.rows.counts)
        if self.shuffle:
            generator = np.random.default_rng(epoch_seed(self.seed, self.epoch))
            units = generator.permutation(units)
        step = self.rows.shards.window
        return [units[i : i + step] for i in range(0, len(units), step)]

    def window_order(self, w: int, units: np.ndarray) -> np.ndarray:
        rows = self.rows
        order = np.concatenate([np.arange(rows.starts[u], rows.starts[u + 1]) for u in units])
        if self.shuffle:
            generator = np.random.default_rng([epoch_seed(self.seed, self.epoch), w])
            order = generator.permutation(order)
        return order

    def indices(self) -> torch.Tensor:
        return torch.tensor(list(self), dtype=torch.int64)

    def __iter__(self) -> Iterator[int]:
        """This process's samples from ``start``: position ``p`` of the epoch's order (after
        ``offset``) is taken by the rule of :meth:`EpochSampler._shard`, by arithmetic."""
        size, rank, batch = self.world.size, self.world.rank, self.batch_size
        total = self.num_samples - self.offset
        strided = self.world.distributed and self.shard == "strided"
        per = batch * size
        full = total // per * per
        tail = total - full
        tail_from = full + rank * (tail // size) + min(rank, tail % size)
        tail_to = tail_from + (tail // size + (rank < tail % size) if tail >= size else 0)
        if strided or size == 1:
            first = self.start * size
        elif self.start <= full // size:  # (start: this process's samples, whole batches)
            first = self.start // batch * per if self.start < full // size else full
        else:  # (its share of the short last global batch taken too: nothing is left)
            first = total
        ahead = self.rows.shards.read_ahead()
        windows, begin = self.windows(), -self.offset
        for w, units in enumerate(windows):
            end = begin + int(self.rows.counts[units].sum())
            if end > first:
                ahead.reach(windows, w)
                at = np.arange(begin, end)
                take = at >= first
                if strided:
                    take &= at % size == rank
                elif size > 1:
                    in_full = (at < full) & (at % per // batch == rank)
                    take &= in_full | ((at >= tail_from) & (at < tail_to))
                yield from self.window_order(w, units)[take].tolist()
            begin = end


def shard_data(d: DataConfig) -> DiskData | TextData:
    """The training and validation rows of ``data.path`` (and ``data.val_path``), the
    classes, the preprocessing saved with the weights, and the text kit for a text column."""
    if not d.path:
        raise DataError("data: data.name = 'parquet' needs data.path (a file, folder, glob or URL)")
    common = {"cache_mb": d.cache_mb, "window": d.shuffle_window}
    train_set = ShardSet(d.path, "data.path", **common)
    sets = [train_set]
    if d.val_path:
        sets.append(ShardSet(d.val_path, "data.val_path", **common))
    kind, inputs = input_kind(
        train_set.schema, train_set.shown, d.label_column, d.image_column, d.text_column
    )
    columns = [*inputs, d.label_column]
    for each in sets:
        for shard, footer in enumerate(each.footers):
            names = footer.schema.to_arrow_schema().names
            if missing := [c for c in columns if c not in names]:
                raise DataError(
                    f"data: '{each.name(shard)}' has no column {missing[0]!r}; columns: "
                    f"{', '.join(names)}"
                )
    classes = class_names(sets, d.label_column)
    for each in sets:
        each.use(columns, classes)
    held = 0.0 if d.val_path else d.val_fraction
    train = ShardRows(train_set, validation=False, held_out=held, seed=d.seed)
    val = ShardRows(sets[-1], validation=not d.val_path, held_out=held, seed=d.seed)
    if len(train) == 0 or len(val) == 0:
        rows = sum(u[2] for u in train_set.units)
        raise DataError(
            f"data: {train_set.shown} has {rows:,} row(s) ({len(train):,} to train on, "
            f"{len(val):,} to validate); training needs at least one of each (more rows, or "
            "data.val_path)"
        )
    biggest = sum(sorted((u[3] for u in train_set.units), reverse=True)[: d.shuffle_window])
    if biggest > train_set.budget:
        raise DataError(
            f"data: a window of {d.shuffle_window} row groups of {train_set.shown} takes up to "
            f"{biggest / 2**20:,.0f} MB decoded, over data.cache_mb = {d.cache_mb}: raise "
            "data.cache_mb or lower data.shuffle_window"
        )
    for rows in (train, val):
        rows.kind, rows.columns = kind, inputs
    sample = _first_rows(train)
    return prepared(d, (train, val), sample, classes)


def class_names(sets: list[ShardSet], label: str) -> list[str]:
    """The classes of the label column over every row group: integer labels ``0..max`` from
    the row groups' statistics where they have them (read otherwise); strings sorted, read
    from the label column alone. A label of 10**12 is refused before a name is built."""
    import pyarrow.types as pt  # type: ignore[import-untyped]

    kind = sets[0].schema.field(label).type
    where = f"{sets[0].shown} column {label!r}"
    rows = sum(u[2] for each in sets for u in each.units)
    if pt.is_integer(kind):
        low, high = 0, -1
        for each in sets:
            for unit, (shard, group, *_) in enumerate(each.units):
                column = (
                    each.footers[shard]
                    .row_group(group)
                    .column(each.footers[shard].schema.to_arrow_schema().get_field_index(label))
                )
                stats = column.statistics
                if stats is not None and stats.has_min_max:
                    low, high = min(low, stats.min), max(high, stats.max)
                else:
                    values = each.read(unit, [label]).column(0).to_numpy(zero_copy_only=False)
                    low, high = min(low, int(values.min())), max(high, int(values.max()))
        if low < 0:
            raise DataError(f"data: {where}: labels must be class indices >= 0 (found {low})")
        return [str(c) for c in range(check_class_count(int(high), rows, where))]
    if pt.is_string(kind) or pt.is_large_string(kind):
        found: set[str] = set()
        for each in sets:
            with ThreadPoolExecutor(16) as pool:
                units = range(len(each.units))
                for part in pool.map(each.read, units, [[label]] * len(units)):
                    check_values(part.column(0), label, where, missing="labels")
                    found.update(part.column(0).unique().to_pylist())
        return sorted(found)
    raise DataError(f"data: {where} holds {kind} values, not class labels (integers or strings)")


def _first_rows(rows: ShardRows) -> Any:
    """Up to :data:`STATS_ROWS` training rows of the first row groups (their inputs): what
    the statistics and the tokenizer are taken from. Read past the cache, which then holds
    only what the epoch reaches (a resume fetches only the row groups left)."""
    import pyarrow as pa

    parts, taken, shards = [], 0, rows.shards
    for unit in range(len(shards.units)):
        if taken >= STATS_ROWS:
            break
        table = shards.checked(unit, shards.read(unit, shards.columns))  # (not cached)
        parts.append(table.take(rows.rows_of(unit)[: STATS_ROWS - taken]))
        taken += parts[-1].num_rows
    sample = pa.concat_tables(parts)
    rows.labels = torch.from_numpy(sample.column(LABEL).to_numpy().astype(np.int64))
    return sample.select(rows.columns)
