"""Training from Parquet shards where they live: a bucket on an S3 server with 20 ms added to
every request, the same shards on local disk, and in memory (fsspec's ``memory://``): steps/s
of the same model, and the peak memory and cache as the data set grows past the cache.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/streaming.py [--workers 2] [--repeats 2]

Writes shards of 64 float32 features and a label (row groups of 8,192 rows: 2 MiB decoded)
into a temporary folder, 1x and 10x ``--cache-mb`` (32 MiB) decoded, copies them into a
moto S3 server on 127.0.0.1 whose every request waits 20 ms first (a WSGI wrapper: what a
region away adds), then, each in a fresh process and interleaved (store, size, repeat), trains
one epoch of an MLP with glassloop's loader (``data.shuffle_window = 4``, batch 256, loader
workers as given). Prints steps/s, the ratio to local disk of the same size and repeat, the
peak memory that is the processes' own (``RssAnon`` of the process and its workers, sampled
every 0.1 s) and the peak bytes in the cache folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROWS_PER_GROUP = 8192
FEATURES = 64


def write(folder: Path, groups: int) -> None:
    """``groups`` row groups of random features, four to a shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for shard in range(0, groups, 4):
        rows = ROWS_PER_GROUP * min(4, groups - shard)
        x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        columns = {f"f{j}": x[:, j] for j in range(FEATURES)}
        table = pa.table({**columns, "label": (x[:, :10].argmax(1)).astype(np.int64)})
        pq.write_table(table, folder / f"part-{shard:05d}.parquet", row_group_size=ROWS_PER_GROUP)


class Slow:
    """A WSGI app that waits ``delay`` seconds before each request."""

    def __init__(self, app: Any, delay: float) -> None:
        self.app, self.delay = app, delay

    def __call__(self, environ: Any, start_response: Any) -> Any:
        time.sleep(self.delay)
        return self.app(environ, start_response)


def s3_server(delay: float) -> dict[str, str]:
    """A moto S3 server on 127.0.0.1 (threaded, in this process) behind :class:`Slow`."""
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (a line per request otherwise)
    app = Slow(DomainDispatcherApplication(create_backend_app), delay)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_address[1]}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


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


class Peaks(threading.Thread):
    """Every 0.1 s: this process's and its workers' own memory, and the cache folder's bytes."""

    def __init__(self, cache: Path) -> None:
        super().__init__(daemon=True)
        self.cache, self.memory, self.cached, self.running = cache, 0.0, 0, True

    def run(self) -> None:
        me = os.getpid()
        while self.running:
            own = anonymous_mib(me) + sum(map(anonymous_mib, children(me)))
            self.memory = max(self.memory, own)
            files = list(self.cache.rglob("*.arrow"))
            self.cached = max(self.cached, sum(f.stat().st_size for f in files if f.exists()))
            time.sleep(0.1)


def measure(path: str, workers: int, cache_mb: int) -> None:
    """One epoch in this process; prints a JSON line."""
    import torch
    from torch import nn

    import glassloop
    from glassloop.data import make_loader
    from glassloop.data.options import DataConfig
    from glassloop.data.shards import shard_data

    if path.startswith("memory://"):  # (this process's store: filled before the clock)
        import fsspec

        fsspec.filesystem("memory").put(os.environ["SHARDS"] + "/", path, recursive=True)
    config = DataConfig(name="parquet", path=path, cache_mb=cache_mb, shuffle_window=4,
                        val_fraction=0.001)  # fmt: skip
    data = shard_data(config)
    loader = make_loader(data.train, batch_size=256, shuffle=True, num_workers=workers)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 10))
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                nn.CrossEntropyLoss(), progress="none")  # fmt: skip
    peaks = Peaks(data.train.shards.folder.parent)
    peaks.start()
    start = time.perf_counter()
    trainer.fit(loader, epochs=1)
    seconds = time.perf_counter() - start
    peaks.running = False
    peaks.join()
    print(json.dumps({"steps": len(loader), "seconds": seconds, "memory_mib": peaks.memory,
                      "cache_mib": peaks.cached / 2**20}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes")
    parser.add_argument("--cache-mb", type=int, default=32, help="data.cache_mb")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each store and size")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="added to each S3 request")
    parser.add_argument("--measure", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.workers, args.cache_mb)
        return
    import s3fs

    env = {**os.environ, **s3_server(args.delay_ms / 1000), "OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    fs = s3fs.S3FileSystem()
    fs.mkdir("shards")
    groups_in_cache = args.cache_mb * 2**20 // (ROWS_PER_GROUP * (FEATURES + 2) * 4)
    with tempfile.TemporaryDirectory() as tmp:
        for times in (1, 10):
            folder = Path(tmp) / f"x{times}"
            write(folder, groups_in_cache * times)
            fs.put(str(folder) + "/", f"shards/x{times}/", recursive=True)
        print(f"cache {args.cache_mb} MiB, {args.workers} loader workers, S3 requests "
              f"+{args.delay_ms:.0f} ms")  # fmt: skip
        print(f"{'store':<7} {'size':>4} {'steps/s':>9} {'vs disk':>8} {'own memory':>11} "
              f"{'cache peak':>11}")  # fmt: skip
        for times in (1, 10):
            for repeat in range(args.repeats):
                local = str(Path(tmp) / f"x{times}")
                stores = [("s3", f"s3://shards/x{times}/"), ("memory", f"memory://x{times}")]
                stores.insert(repeat % 3, ("disk", local))  # (interleaved: disk not always first)
                disk, results = 0.0, []
                for store, path in stores:
                    child = {**env, "SHARDS": local, "GLASSLOOP_CACHE_DIR": str(Path(tmp) / "c")}
                    done = subprocess.run(
                        [sys.executable, __file__, "--workers", str(args.workers), "--cache-mb",
                         str(args.cache_mb), "--measure", path],
                        capture_output=True, text=True, env=child, check=False,
                    )  # fmt: skip
                    if done.returncode:
                        print(f"{store}: failed: {done.stderr.strip()[-2000:]}")
                        continue
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    rate = result["steps"] / result["seconds"]
                    disk = rate if store == "disk" else disk
                    results.append((store, rate, result["memory_mib"], result["cache_mib"]))
                for store, rate, memory, cache in results:
                    print(f"{store:<7} {times:>3}x {rate:>9,.1f} {rate / disk:>8.2f} "
                          f"{memory:>7,.0f} MiB {cache:>7,.1f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
