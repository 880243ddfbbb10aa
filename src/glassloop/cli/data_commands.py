"""The ``glassloop data`` commands: ``data shard`` writes a data set as Parquet shards
(:mod:`glassloop.tools.shard_writer`). Declared and run here; :func:`add_data_commands` adds
them to the parser of :mod:`glassloop.cli.main`."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_data_commands(
    commands: argparse._SubParsersAction[Any], count: Callable[[str], int]
) -> None:
    """``glassloop data`` and its subcommands; ``count``: the argparse type of a whole number
    of 1 or more."""
    data = commands.add_parser(
        "data",
        help="prepare data: write a CSV, image folder, .npz or datasets folder as Parquet shards",
        description="Prepare a data set for training: glassloop data shard INPUT OUTPUT "
        "--rows-per-shard N writes it as Parquet shards, which data.name = 'parquet' streams "
        "from a folder or object storage.",
    )
    tasks = data.add_subparsers(dest="data_command", metavar="COMMAND", parser_class=type(data))
    tasks.required = True
    shard = tasks.add_parser(
        "shard",
        help="write a data set as Parquet shards of N rows (data.name = 'parquet' reads them)",
        description="Write INPUT as Parquet shards OUTPUT/part-00000.parquet, ... of N rows "
        "each (the last fewer), in row groups of M rows, every page checksummed; each shard "
        "appears whole or not at all. INPUT: a .csv file (streamed: any size; its columns as "
        "they are), a folder with one sub-folder of images per class (columns image and "
        "label, in a seeded random order), an .npz with arrays x and y (features x0, x1, ... "
        "or images as PNG in image; label), a folder written by datasets' save_to_disk, or "
        "a .parquet file.",
    )
    shard.add_argument("data_input", metavar="INPUT", help="the data set to convert")
    shard.add_argument(
        "data_output",
        metavar="OUTPUT",
        help="a new or empty folder, or a URL prefix on object storage (s3://bucket/train)",
    )
    shard.add_argument(
        "--rows-per-shard",
        type=count,
        required=True,
        metavar="N",
        help="rows in each shard (the last one: what is left)",
    )
    shard.add_argument(
        "--row-group-rows",
        type=count,
        metavar="M",
        help="rows in each row group, the unit the reader decodes, caches and shuffles "
        "(default: N or 10,000, the smaller)",
    )


def cmd_data(args: argparse.Namespace) -> int:
    """``glassloop data shard``: the shards, a line each, then the total."""
    from glassloop.errors import writing
    from glassloop.storage.file_names import is_url
    from glassloop.tools.shard_writer import write_shards

    assert args.data_command == "shard"  # (the one data command)
    output = args.data_output
    # (a local folder that cannot be written, full or read-only: one line, exit code 3)
    held = writing("data shard", Path(output), "the shards written so far were removed")
    with held if not is_url(output) else contextlib.nullcontext():
        written = write_shards(
            args.data_input,
            output,
            rows_per_shard=args.rows_per_shard,
            row_group_rows=args.row_group_rows,
        )
    print(written.line())
    return 0  # (EXIT_OK)
