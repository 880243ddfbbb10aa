"""shard_writer: a data set as Parquet shards of N rows, in row groups of M rows, every page
checksummed. The shards, ``part-00000.parquet``, ``part-00001.parquet``, ..., go into a new
folder or under a URL prefix on any fsspec store (``s3://bucket/train``): what ``glassloop
data shard`` writes, and what ``data.name = "parquet"`` streams back.

What it reads: a CSV file (streamed a block at a time with ``pyarrow.csv.open_csv``: never
the whole file in memory; its columns as they are), a folder of class sub-folders of images
(columns ``image``, the encoded file bytes as they are, and ``label``, the folder's name), an
``.npz`` with arrays ``x`` and ``y`` (as ``data.name = "npz"`` reads them: ``x`` of shape
``(N, F)`` gives columns ``x0``... ``x{F-1}``; images ``(N, H, W)`` or ``(N, H, W, C)`` an
``image`` column of PNG bytes), a folder written by Hugging Face ``datasets``'
``save_to_disk`` (its columns, an ``Image`` column as its encoded bytes) or a Parquet file.

Why row groups of a fixed size: a row group is what the reader decodes, caches and shuffles
(``data.shuffle_window`` of them at a time), so each one holds exactly M rows (a shard's last
one N mod M, the last shard's fewer), whatever size the blocks came in. Why page checksums:
a flipped bit in a numeric page decodes as another valid number; with a CRC-32 on every page
the reader notices instead. A folder of images has no order of its own (glassloop lists it
sorted, by class): its rows are written in a seeded random order, so that a row group holds
every class rather than one; every other input keeps its rows' order.

A shard appears whole or not at all: on disk it is written beside its name and renamed into
place (:func:`glassloop.storage.atomic.atomic_path`); on a store, written locally and then
uploaded (an object appears when its upload completes). A conversion that fails half-way
removes the shards it wrote (only those: OUTPUT must be new or empty), so what is left is
never a data set that looks whole and is not; a killed one can leave some behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from glassloop.errors import CheckpointWriteError, DataError
from glassloop.storage.atomic import atomic_path, own_dir
from glassloop.storage.file_names import is_url
from glassloop.storage.redaction import printable, redact, redacted, remember_secrets

ROW_GROUP_ROWS = 10_000  # the default M (at most N): a few MB of numbers, a cache's unit
SHARD = "part-{:05d}.parquet"
# What pyarrow infers a CSV column's type from: its first block. A larger one sees more rows
# (an integer column whose first real number comes later is read again, see _csv_tables).
CSV_BLOCK_BYTES = 16 << 20
BATCH_ROWS = 1_024  # rows of an in-memory input (images, arrays) made into one table at a time
IMAGE_SEED = 0  # the order an image folder's rows are written in (see the module docstring)
SAY = "data shard"


@dataclass
class Written:
    """What :func:`write_shards` wrote: its rows, shards and bytes, and where (as shown:
    a URL's secrets replaced)."""

    rows: int
    shards: int
    bytes: int
    where: str

    def line(self) -> str:
        shards = counted(self.shards, "shard")
        return (
            f"{SAY}: {counted(self.rows, 'row')} in {shards} ({self.bytes:,} bytes) in {self.where}"
        )


def counted(number: int, thing: str) -> str:
    """``3 shards``, ``1 shard``, ``12,000 rows``."""
    return f"{number:,} {thing}{'' if number == 1 else 's'}"


def write_shards(
    source: str | Path,
    output: str | Path,
    *,
    rows_per_shard: int,
    row_group_rows: int | None = None,
    say: Callable[[str], None] = print,
) -> Written:
    """Write the data set at ``source`` (a ``.csv``, a folder of images, an ``.npz``, a
    ``datasets`` folder or a ``.parquet`` file) as shards of ``rows_per_shard`` rows in row
    groups of ``row_group_rows`` (default ``min(rows_per_shard, 10_000)``) into ``output``,
    a new or empty folder or a URL prefix (``s3://bucket/train``); ``say`` gets a line per
    shard written.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "rows.csv").write_text("a,b,label\\n" + "0.5,1,0\\n" * 5)
    >>> done = write_shards(folder / "rows.csv", folder / "shards", rows_per_shard=2)
    ... # doctest: +ELLIPSIS
    wrote .../shards/part-00000.parquet: 2 rows, 1 row group, ... bytes
    wrote .../shards/part-00001.parquet: 2 rows, 1 row group, ... bytes
    wrote .../shards/part-00002.parquet: 1 row, 1 row group, ... bytes
    >>> done.rows, done.shards
    (5, 3)
    """
    group_rows = min(rows_per_shard, ROW_GROUP_ROWS) if row_group_rows is None else row_group_rows
    if rows_per_shard < 1 or group_rows < 1:
        raise DataError(f"{SAY}: rows per shard and per row group must be 1 or more")
    if group_rows > rows_per_shard:
        raise DataError(
            f"{SAY}: row groups of {group_rows:,} rows do not fit in shards of "
            f"{rows_per_shard:,} (a row group lies in one shard): give --row-group-rows "
            f"{rows_per_shard:,} or less"
        )
    if is_url(str(source)):
        raise DataError(
            f"{SAY}: INPUT {redact(str(source))!r} is a URL; INPUT is read from this machine: "
            "copy it here first (OUTPUT may be a URL)"
        )
    read = reader_of(Path(source))
    target = open_target(str(output))
    types: dict[str, Any] = {}  # a CSV column's type, where its first block was not enough
    while True:
        try:
            tables = read(types)
            return target.write(row_groups(tables, rows_per_shard, group_rows), say)
        except Retype as change:  # (its shards removed: the new type is every shard's)
            assert types.get(change.column) != change.type, change.column  # (never twice)
            types[change.column] = change.type
            value = printable(change.value, 60)
            say(
                f"{SAY}: column {change.column!r} holds '{value}' after rows read as "
                f"{change.was}: reading it as {change.type} from the start again"
            )


# ------------------------------------------------------------------------------ the inputs
Tables = Iterator[Any]  # pyarrow Tables of one schema, the rows in order
Reader = Callable[[dict[str, Any]], Tables]


def reader_of(source: Path) -> Reader:
    """What reads ``source``, chosen by what it is; one line when it is none of them."""
    if not source.exists():
        raise DataError(f"{SAY}: INPUT '{source}' not found")
    suffix = source.suffix.lower()
    if source.is_file() and suffix == ".csv":
        return lambda types: _csv_tables(source, types)
    if source.is_file() and suffix == ".npz":
        return lambda _: _npz_tables(source)
    if source.is_file() and suffix == ".parquet":
        return lambda _: _parquet_tables(source)
    if source.is_dir() and any((source / n).is_file() for n in HF_FILES):
        return lambda _: _hf_tables(source)
    if source.is_dir():
        return _image_folder(source)
    raise DataError(
        f"{SAY}: INPUT '{source}' is none of what glassloop converts: a .csv file, a folder "
        "with one sub-folder of images per class, an .npz with arrays x and y, a folder "
        "written by datasets' save_to_disk, or a .parquet file"
    )


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError as err:
        raise DataError(f"{SAY}: writing Parquet needs pyarrow: pip install pyarrow") from err
    return pa, pq


class Retype(Exception):
    """A CSV column that holds a value its first block's type cannot (``1``, ``2``, then
    ``2.5``): the conversion starts again with the column read as ``type``."""

    def __init__(self, column: str, was: str, value: str, type: Any) -> None:
        super().__init__(column)
        self.column, self.was, self.value, self.type = column, was, value, type


def _csv_tables(path: Path, types: dict[str, Any]) -> Tables:
    """The CSV's rows a block at a time, each column's type the first block's (``types``:
    those known to need another). A later value the type cannot hold raises :class:`Retype`:
    an integer column becomes float64 (when the value is a number), any other one string;
    a column that is not UTF-8 text is refused, as ``data.name = "csv"`` does."""
    pa, _ = _pyarrow()
    from pyarrow import csv

    def refused(err: Exception | str) -> DataError:
        return DataError(f"{SAY}: '{path}' is not a CSV file glassloop can read: {err}")

    try:
        stream = csv.open_csv(
            path,
            read_options=csv.ReadOptions(block_size=CSV_BLOCK_BYTES),
            convert_options=csv.ConvertOptions(column_types=types),
        )
    except pa.ArrowInvalid as err:
        raise refused(err) from None
    names = stream.schema.names
    for field in stream.schema:
        if pa.types.is_binary(field.type):  # (what pyarrow makes of bytes that are not text)
            raise refused(f"column {field.name!r} is not UTF-8 text; save it as UTF-8")
    while True:
        try:
            batch = stream.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as err:
            column = re.search(r"In CSV column #(\d+):", str(err))
            failed = re.search(r"conversion error to (\w+): invalid value '(.*)'", str(err))
            if column is not None and "invalid UTF8" in str(err):
                name = names[int(column.group(1))]
                raise refused(f"column {name!r} is not UTF-8 text; save it as UTF-8") from None
            if column is None or failed is None:
                raise refused(err) from None
            name, was, value = names[int(column.group(1))], failed.group(1), failed.group(2)
            wider = pa.string()
            if re.fullmatch(r"u?int\d+", was):
                with contextlib.suppress(ValueError):
                    float(value)  # (a number: the column's integers and it fit float64)
                    wider = pa.float64()
            raise Retype(name, was, value, wider) from None
        yield pa.Table.from_batches([batch])


def _npz_tables(path: Path) -> Tables:
    """``x`` and ``y`` of an ``.npz``, read as ``data.name = "npz"`` reads them (never
    unpickling, every array's header checked first): rows of features as columns ``x0``...,
    images as PNG bytes in ``image``; ``y`` as ``label``."""
    import numpy as np

    from glassloop.data.raw_files import load_arrays

    pa, _ = _pyarrow()
    arrays = load_arrays(path, SAY)
    if not {"x", "y"} <= arrays.keys():
        split = {"x_train", "y_train"} <= arrays.keys()
        hint = ": save each split's x and y as an .npz of its own and convert each" if split else ""
        raise DataError(f"{SAY}: '{path}' must hold arrays x and y; found {sorted(arrays)}{hint}")
    x, y = arrays["x"], arrays["y"]
    if y.ndim != 1 or len(x) != len(y):
        raise DataError(
            f"{SAY}: '{path}' holds x of shape {x.shape} and y of shape {y.shape}; give one "
            "label per row of x (y of shape (N,))"
        )
    if x.ndim in (3, 4):
        pixels = _pixels(x, path)
        for start in range(0, len(x), BATCH_ROWS):
            rows = slice(start, start + BATCH_ROWS)
            images = pa.array([_png(image) for image in pixels[rows]], pa.binary())
            yield pa.table({"image": images, "label": y[rows]})
        return
    x = x.reshape(len(x), -1) if x.ndim == 1 else x
    if x.ndim != 2:
        raise DataError(
            f"{SAY}: '{path}' array x has shape {x.shape}; glassloop writes rows of features "
            "(N, F) or images (N, H, W) or (N, H, W, C)"
        )
    names = [f"x{i}" for i in range(x.shape[1])]
    for start in range(0, len(x), BATCH_ROWS):
        part = np.ascontiguousarray(x[start : start + BATCH_ROWS].T)  # (a column a row)
        columns = dict(zip(names, part, strict=True))
        yield pa.table({**columns, "label": y[start : start + BATCH_ROWS]})


def _pixels(x: Any, path: Path) -> Any:
    """Images ``(N, H, W[, C])`` as uint8 pixels ``(N, H, W)`` or ``(N, H, W, C)`` (C 1, 3
    or 4; channels first are moved last): floats in [0, 1] are scaled by 255, values in
    [0, 255] rounded; anything else is refused (standardised pixels are not an image)."""
    import numpy as np

    if x.ndim == 4 and x.shape[-1] not in (1, 3, 4) and x.shape[1] in (1, 3, 4):
        x = x.transpose(0, 2, 3, 1)
    if x.ndim == 4 and x.shape[-1] not in (1, 3, 4):
        raise DataError(
            f"{SAY}: '{path}' array x has shape {x.shape}: images of {x.shape[-1]} channels; "
            "glassloop writes images of 1, 3 or 4 channels as PNG"
        )
    if x.dtype == np.uint8:
        return x
    if not len(x) or not np.isfinite(x).all() or x.min() < 0 or x.max() > 255:
        raise DataError(
            f"{SAY}: '{path}' array x holds images whose values are not pixels (0 to 255, "
            "or 0 to 1 as floats); save them before normalising"
        )
    scale = 255.0 if x.dtype.kind == "f" and x.max() <= 1.0 else 1.0
    return np.rint(x * scale).astype(np.uint8)


def _png(pixels: Any) -> bytes:
    import io

    from PIL import Image

    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG")
    return encoded.getvalue()


def _image_folder(root: Path) -> Reader:
    """``root/<class>/<image>`` as rows of ``image`` (the file's bytes, as they are) and
    ``label`` (the folder's name), listed as ``data.name = "image-folder"`` lists them and
    written in a seeded random order; each file is checked to be an image (its header)."""
    import numpy as np

    from glassloop.data.files import image_listing
    from glassloop.data.options import DataConfig
    from glassloop.data.raw_files import open_image

    names, listings = image_listing(DataConfig(name="image-folder", path=str(root)))
    if len(listings) > 1:
        raise DataError(
            f"{SAY}: '{root}' holds train/ and val/: convert each on its own (INPUT "
            f"'{root / 'train'}', then '{root / 'val'}', each into its own OUTPUT)"
        )
    files, labels = listings[0]
    order = np.random.default_rng(IMAGE_SEED).permutation(len(files))

    def tables(_: dict[str, Any]) -> Tables:
        pa, _ = _pyarrow()
        for start in range(0, len(order), BATCH_ROWS):
            chosen = order[start : start + BATCH_ROWS]
            images = []
            for i in chosen:
                with open_image(files[i], SAY):
                    pass  # (a file that is not an image: one line now, not in training)
                images.append(files[i].read_bytes())
            label = [names[labels[i]] for i in chosen]
            yield pa.table({"image": pa.array(images, pa.binary()), "label": label})

    return tables


# The files a datasets.save_to_disk folder holds (a Dataset's; a DatasetDict's).
HF_FILES = ("dataset_info.json", "dataset_dict.json")


def _hf_tables(folder: Path) -> Tables:
    """A folder written by ``datasets``' ``save_to_disk``, its columns as they are but an
    ``Image`` column, which becomes its encoded bytes (``save_to_disk`` put a local file's
    bytes in); a row without an image is refused, as the reader would refuse it."""
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError as err:
        raise DataError(
            f"{SAY}: '{folder}' was written by Hugging Face datasets, which reads it: "
            "pip install datasets"
        ) from err
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    try:
        loaded: Any = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as err:
        raise DataError(f"{SAY}: '{folder}' is not a readable datasets folder: {err}") from err
    if isinstance(loaded, datasets.DatasetDict):
        raise DataError(
            f"{SAY}: '{folder}' holds the splits {', '.join(loaded)}: convert each split's "
            f"folder on its own (INPUT '{folder / next(iter(loaded))}', ...)"
        )
    images = [name for name, kind in loaded.features.items() if isinstance(kind, datasets.Image)]
    done = 0
    for table in loaded.with_format("arrow").iter(batch_size=BATCH_ROWS):
        for name in images:
            encoded = pc.struct_field(table[name], "bytes")
            if encoded.null_count:
                row = done + encoded.is_null().to_pylist().index(True)
                raise DataError(
                    f"{SAY}: '{folder}' column {name!r} has no image in row {row}; drop such "
                    f"rows first (dataset.filter(lambda row: row[{name!r}] is not None))"
                )
            table = table.set_column(table.schema.get_field_index(name), name, encoded)
        done += table.num_rows
        yield table.replace_schema_metadata(None)  # (its features no longer describe it)


def _parquet_tables(path: Path) -> Tables:
    """A Parquet file's rows, a batch at a time (into shards of its own size, checksummed)."""
    pa, pq = _pyarrow()
    try:
        file = pq.ParquetFile(path)
        for batch in file.iter_batches(batch_size=ROW_GROUP_ROWS):
            yield pa.Table.from_batches([batch])
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{SAY}: '{path}' is not a readable Parquet file: {err}") from None


def row_groups(tables: Tables, rows_per_shard: int, group_rows: int) -> Iterator[tuple[Any, bool]]:
    """Each row group of ``tables``' rows in order, and whether it ends its shard:
    ``group_rows`` rows, fewer at a shard's end (``rows_per_shard`` mod ``group_rows``) and in
    the last one. A group that does not fill its shard waits for the next (only then is it
    known whether the input ends with it): at most two row groups and a table are held.

    >>> import pyarrow as pa
    >>> rows = iter([pa.table({"a": range(4)}), pa.table({"a": range(4, 7)})])
    >>> [(len(group), ends) for group, ends in row_groups(rows, 5, 2)]
    [(2, False), (2, False), (1, True), (2, True)]
    """
    pa, _ = _pyarrow()
    pending: list[Any] = []
    waiting = None  # (a group that does not fill its shard)
    held = done = 0
    for table in tables:
        pending.append(table)
        held += table.num_rows
        while held >= (size := min(group_rows, rows_per_shard - done % rows_per_shard)):
            rows = pa.concat_tables(pending)
            pending, held, done = [rows.slice(size)], held - size, done + size
            if waiting is not None:
                yield waiting, False
            waiting = rows.slice(0, size)
            if done % rows_per_shard == 0:
                yield waiting, True
                waiting = None
    if waiting is not None:
        yield waiting, not held
    if held:
        yield pa.concat_tables(pending), True


# ----------------------------------------------------------------------------- the output
class Target:
    """Where the shards go: :meth:`shard` gives a local file to write one into and puts it
    in place when the block ends; :meth:`remove` takes back the ones written."""

    shown: str

    def shard(self, name: str) -> contextlib.AbstractContextManager[Path]:
        raise NotImplementedError

    def remove(self, names: list[str]) -> None:
        raise NotImplementedError

    def write(self, groups: Iterator[tuple[Any, bool]], say: Callable[[str], None]) -> Written:
        """Each shard's row groups into its file (page checksums on), put in place as soon as
        its last one is in; on any failure the shards written are removed, and the error goes
        on."""
        _, pq = _pyarrow()
        written: list[str] = []
        rows = size = 0
        try:
            for first, ends in groups:
                name = SHARD.format(len(written))
                with self.shard(name) as path:
                    with pq.ParquetWriter(path, first.schema, write_page_checksum=True) as writer:
                        writer.write_table(first, row_group_size=first.num_rows)
                        count, num_groups = first.num_rows, 1
                        while not ends:
                            group, ends = next(groups)  # (the last one of the input ends too)
                            writer.write_table(group, row_group_size=group.num_rows)
                            count, num_groups = count + group.num_rows, num_groups + 1
                    nbytes = path.stat().st_size
                written.append(name)
                rows, size = rows + count, size + nbytes
                said = f"{counted(count, 'row')}, {counted(num_groups, 'row group')}"
                say(f"wrote {self.shown}/{name}: {said}, {nbytes:,} bytes")
        except BaseException:
            if written:
                self.remove(written)
                say(f"{SAY}: removed the {counted(len(written), 'shard')} written so far")
            raise
        if not written:
            raise DataError(f"{SAY}: the input holds no rows; nothing was written")
        return Written(rows, len(written), size, self.shown)


def open_target(output: str) -> Target:
    """``output`` as a :class:`Target`, checked before anything is read or written."""
    if output.startswith("file://"):
        output = output[len("file://") :]
    return StoreTarget(output) if is_url(output) else FolderTarget(Path(output))


class FolderTarget(Target):
    """A new or empty local folder, never a link (nor one inside it written through)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.shown = folder, str(folder)
        if os.path.islink(folder):
            raise DataError(
                f"{SAY}: OUTPUT '{folder}' is a symbolic link; glassloop writes shards only "
                "into a folder of its own, never through a link: give a new folder"
            )
        if folder.exists() and not folder.is_dir():
            raise DataError(f"{SAY}: OUTPUT '{folder}' is a file; give a new or empty folder")
        found = sorted(os.listdir(folder)) if folder.is_dir() else []
        if found:
            raise DataError(
                f"{SAY}: OUTPUT '{folder}' is not empty (it holds {found[0]!r}"
                f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}); glassloop never "
                "writes among files that are not its own: give a new or empty folder"
            )
        self.made = not folder.exists()

    def shard(self, name: str) -> contextlib.AbstractContextManager[Path]:
        return atomic_path(own_dir(self.folder) / name)

    def remove(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                (self.folder / name).unlink()  # (a link itself, never what it names)
        if self.made:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # (only if empty: nothing else is ever removed)


class StoreTarget(Target):
    """A URL prefix on an fsspec store with nothing under it yet; each shard is written to
    a local file, then uploaded."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError as err:
            raise DataError(
                f"{SAY}: OUTPUT {redacted(url)!r} is on a remote filesystem, which needs "
                "fsspec and its driver: pip install 'glassloop[cloud]'"
            ) from err
        remember_secrets(url)  # (a driver's own message may quote them: never printed)
        self.url = url.rstrip("/")
        self.shown = redacted(self.url)
        if urlsplit(self.url).query or urlsplit(self.url).fragment:
            raise DataError(
                f"{SAY}: OUTPUT {self.shown!r} has a query ('?...') or a fragment ('#...'), "
                "which would become part of every object's name; give the URL without it "
                "and credentials through the driver's own sources (environment variables)"
            )
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as err:
            raise DataError(
                f"{SAY}: cannot open {self.shown}: {redact(str(err))} (the driver for this "
                "scheme is missing? s3:// needs s3fs, gs:// gcsfs, az:// adlfs)"
            ) from None
        self.root = root.rstrip("/")
        split = getattr(self.fs, "split_path", None)  # (an object store's bucket)
        if callable(split) and not self.fs.exists(split(self.root)[0]):
            raise DataError(
                f"{SAY}: the bucket of {self.shown} does not exist (or these credentials "
                "cannot see it); glassloop never creates one: create it or correct the URL"
            )
        if self.fs.isfile(self.root) or (self.fs.isdir(self.root) and self.fs.ls(self.root)):
            raise DataError(
                f"{SAY}: OUTPUT {self.shown} already holds objects; glassloop never writes "
                "among objects that are not its own: give a new prefix"
            )

    @contextlib.contextmanager
    def _shard(self, name: str) -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix="glassloop-shard-") as folder:
            yield Path(folder) / name
            try:
                self.fs.put_file(str(Path(folder) / name), f"{self.root}/{name}")
            except Exception as err:  # the driver's own errors: the network, permissions
                raise CheckpointWriteError(
                    f"{SAY}: could not write {self.shown}/{name}: {redact(str(err))[:300]}"
                ) from None

    def shard(self, name: str) -> contextlib.AbstractContextManager[Path]:
        return self._shard(name)

    def remove(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(Exception):
                self.fs.rm_file(f"{self.root}/{name}")
