"""What a Parquet table's columns give the model, and the checks on their values.

A row's inputs are the numeric columns but the label (standardised with the training rows'
statistics), one ``image_column`` of encoded image bytes (PNG/JPEG, decoded in the worker,
scaled to [0, 1] and standardised per channel), or one ``text_column`` of strings (tokenized
in the worker); the target is ``label_column`` (integer class indices or strings). Where
the rows come from, in what order, and how they are cached: :mod:`glassloop.data.shards`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from glassloop.data.splits import check_class_count
from glassloop.errors import DataError

if TYPE_CHECKING:
    from glassloop.data.shards import ShardSet


def input_kind(
    schema: Any, shown: str, label: str, image_column: str, text_column: str
) -> tuple[str, list[str]]:
    """What the rows give the model and from which columns: ``"image"`` (``image_column``
    set), ``"text"`` (a string column named ``text_column``), else ``"numeric"`` (every
    numeric column but the label). A table with both a text column and numeric feature
    columns is refused: which one is meant is not for glassloop to guess."""
    import pyarrow.types as pt  # type: ignore[import-untyped]

    if image_column:
        return "image", [image_column]
    kind = schema.field(text_column).type if text_column in schema.names else None
    text = kind is not None and (pt.is_string(kind) or pt.is_large_string(kind))
    numeric = [f.name for f in schema if f.name != label and _numeric(f.type)]
    if text and numeric:
        raise DataError(
            f"data: {shown} has a text column {text_column!r} and numeric columns "
            f"({', '.join(numeric[:5])}); train on the text: drop the numeric columns; on the "
            "numbers: set data.text_column = ''"
        )
    if text:
        return "text", [text_column]
    if not numeric:
        raise DataError(f"data: {shown} has no numeric feature columns besides the label")
    return "numeric", numeric


def class_names(sets: list[ShardSet], label: str) -> list[str]:
    """The classes of the label column over every row group: integer labels ``0..max`` from
    the row groups' statistics where they have them (read otherwise); strings sorted, read
    from the label column alone. A label of 10**12 is refused before a name is built."""
    import pyarrow.types as pt

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


def check_values(column: Any, name: str, where: str, *, missing: str = "") -> None:
    """Numbers present and finite, texts present and UTF-8 (Parquet checks neither): a bad
    value is one line naming the column and its row, never a traceback mid-training."""
    import pyarrow as pa
    import pyarrow.compute as pc  # type: ignore[import-untyped]

    if column.null_count:
        row = int(np.flatnonzero(pc.is_null(column).to_numpy(zero_copy_only=False))[0])
        raise DataError(
            f"data: {where} column {name!r} row {row}: a missing value (null); "
            f"{missing or 'inputs'} must be present: fill or drop the missing values first"
        )
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:  # find the row for the message
            for row in range(len(column)):
                try:
                    column[row].as_py()
                except (UnicodeDecodeError, ValueError):
                    raise DataError(
                        f"data: {where} column {name!r} row {row}: bytes that are not UTF-8 "
                        "text; re-encode the column as UTF-8"
                    ) from None
            raise
    elif _numeric(column.type):
        numbers = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(numbers))
        if bad.size:
            raise DataError(
                f"data: {where} column {name!r} row {int(bad[0])}: {numbers[bad[0]]} (NaN or "
                "infinite); features must be finite numbers: clean the column first"
            )


def _numeric(kind: Any) -> bool:
    import pyarrow.types as pt

    return bool(pt.is_integer(kind) or pt.is_floating(kind) or pt.is_boolean(kind))
