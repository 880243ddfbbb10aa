"""Parquet on disk against the same images in memory: samples/s and peak memory (RSS).

    .venv/bin/python benchmarks/parquet_memory.py --gigabytes 2 [--workers 2] [--modes parquet]

Writes a Parquet file of random 64x64 RGB PNGs (incompressible: ~12 KB each) of the given
size into a temporary directory, then, each in a fresh process, iterates one epoch of
glassloop's loaders over it: ``data.name = "parquet"`` with worker processes (lazy, memory
mapped), and the same images decoded into a tensor in memory first (what ``image-folder``
and the fast path do). Prints samples/s (decoding included), the peak of the memory that is
the processes' own (``RssAnon`` of the process and its workers, sampled every 0.1 s) and the
peak RSS of the main process (which also counts pages of the memory-mapped file: cache the
operating system reclaims, not the process's). ``--modes parquet`` skips the in-memory run,
which needs about 11 GB of memory per GB of PNGs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def write(path: Path, gigabytes: float) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    writer, rows, size = None, 0, 0
    while size < gigabytes * 2**30:
        images = []
        for _ in range(2000):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
            images.append(buffer.getvalue())
        size += sum(map(len, images))
        table = pa.table({"png": images, "label": rng.integers(0, 10, len(images))})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
        rows += len(images)
    assert writer is not None
    writer.close()
    return rows


def anonymous_mib(pid: int) -> float:
    """Memory that is the process's own (``RssAnon``: heap, tensors), not file cache."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


class PeakMemory(threading.Thread):
    """Samples this process's and its workers' own memory every 0.1 s; keeps the peak sum."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0.0, True

    def run(self) -> None:
        me = os.getpid()
        while self.running:
            total = anonymous_mib(me) + sum(anonymous_mib(c) for c in children(me))
            self.peak = max(self.peak, total)
            time.sleep(0.1)


def measure(path: str, mode: str, workers: int) -> None:
    """One epoch in this process; prints a JSON line (run in a fresh process per mode)."""
    import torch

    from glassloop.config.assemble import parquet_data
    from glassloop.config.schema import load_config
    from glassloop.data import make_loader
    from glassloop.data.lazy import read_image

    cfg = load_config(None, [
        "data.name=parquet", f"data.path={path}", "data.image_column=png",
        f"data.num_workers={workers}", "data.batch_size=256", "data.val_fraction=0.01",
    ])  # fmt: skip
    data = parquet_data(cfg)  # (the Arrow copy is written here, once, before the clock)
    sampler = PeakMemory()
    sampler.start()
    start = time.perf_counter()
    if mode == "parquet":
        loader = make_loader(data.train, batch_size=256, shuffle=True, num_workers=workers)
    else:  # decode everything into one tensor first, then the fast in-memory path
        import pyarrow.parquet as pq

        pngs = pq.read_table(path, columns=["png"]).column(0).to_pylist()
        rows = data.train
        images = torch.stack([read_image(pngs[i], rows.image_shape) for i in rows.indices])
        del pngs
        loader = make_loader((images, rows.labels), batch_size=256, shuffle=True)
    seen = sum(len(batch[1]) for batch in loader)
    seconds = time.perf_counter() - start
    sampler.running = False
    sampler.join()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": mode, "samples": seen, "seconds": seconds,
                      "peak_own_mib": sampler.peak, "peak_rss_mib": own}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0, help="size of the generated file")
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["parquet", "in-memory"],
        choices=["parquet", "in-memory"],
        help="what to measure",
    )
    parser.add_argument("--measure", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure[0], args.measure[1], args.workers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "images.parquet"
        start = time.perf_counter()
        rows = write(path, args.gigabytes)
        size = path.stat().st_size / 2**30
        print(f"{rows:,} PNG images, {size:.2f} GiB on disk, written in "
              f"{time.perf_counter() - start:.0f} s")  # fmt: skip
        for mode in args.modes:
            done = subprocess.run(
                [sys.executable, __file__, "--workers", str(args.workers), "--measure",
                 str(path), mode], capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode:
                print(f"{mode}: failed: {done.stderr.strip().splitlines()[-1]}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rate = result["samples"] / result["seconds"]
            print(f"{mode:<10} {rate:>9,.0f} samples/s  own memory (process + workers) "
                  f"{result['peak_own_mib']:,.0f} MiB  RSS with mapped file pages "
                  f"{result['peak_rss_mib']:,.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
