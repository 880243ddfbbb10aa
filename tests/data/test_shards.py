"""Parquet shards where they live (data.path: a folder, a glob, a URL prefix): the order is
the in-memory loaders' rule drawn a window at a time; a bucket of shards on a real S3 server
trains, is killed with SIGKILL and resumes bitwise in a new process, every reported number
equal; a resume reads only the row groups left; the cache stays within data.cache_mb on a
data set ten times its size; a bad or changed shard is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_runner import run_glassloop, sets
from s3_server import local_s3

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

import glassloop  # noqa: E402
from glassloop.data.loaders import EpochSampler, ResumableLoader  # noqa: E402
from glassloop.data.options import DataConfig  # noqa: E402
from glassloop.data.shards import ShardSet, shard_data  # noqa: E402
from glassloop.distributed.world import World  # noqa: E402


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLASSLOOP_CACHE_DIR", str(tmp_path / "cache"))


def write_shards(folder: Path, shards: int = 5, rows: int = 60, group: int = 20) -> Path:
    """``shards`` files of ``rows`` rows (the last shorter) in row groups of ``group``: two
    features, a row id and a label a small MLP learns."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(shards):
        n = rows - 7 * (i == shards - 1)
        x = rng.normal(size=(n, 2))
        table = pa.table({"a": x[:, 0], "b": x[:, 1], "id": np.arange(n) + 1000.0 * i,
                          "label": (x[:, 0] + x[:, 1] > 0).astype(np.int64)})  # fmt: skip
        pq.write_table(table, folder / f"part-{i:05d}.parquet", row_group_size=group,
                       write_page_checksum=True)  # fmt: skip
    return folder


def test_the_order_is_the_in_memory_rule_drawn_a_window_at_a_time(tmp_path: Path) -> None:
    """For any number of processes, rank, position and offset, the streamed sampler yields
    exactly what EpochSampler's rule gives over the epoch's whole order (so every guarantee
    of the in-memory loaders, elastic resume included, holds), never drawing that order."""
    data = shard_data(DataConfig(name="parquet", path=str(write_shards(tmp_path / "d")),
                                 shuffle_window=3))  # fmt: skip
    rows = data.train
    n = len(rows)
    assert len(rows.shards.units) == 15
    for shuffle in (True, False):
        for size, rank in ((1, 0), (2, 1), (3, 0), (3, 2)):
            for shard in ("batches", "strided"):
                for offset, start in ((0, 0), (0, 20), (7, 4), (0, 10_000)):
                    options: dict[str, Any] = {"shuffle": shuffle, "seed": 3, "batch_size": 4,
                                               "world": World(rank, size), "shard": shard}  # fmt: skip
                    sampler = rows.order_sampler(n, **options)
                    rule = EpochSampler(n, **options)
                    for each in (sampler, rule):
                        each.epoch, each.offset, each.start = 2, offset, start
                    whole = np.concatenate([sampler.window_order(w, u)
                                            for w, u in enumerate(sampler.windows())])  # fmt: skip
                    order = torch.as_tensor(whole)[offset:]
                    expected = (rule._shard(order) if size > 1 else order)[start:].tolist()
                    assert list(iter(sampler)) == expected, (shuffle, size, rank, shard, start)
    once = rows.order_sampler(n, shuffle=True, seed=1, batch_size=4)
    assert sorted(iter(once)) == list(range(n))  # each row once an epoch


def test_a_resume_reads_only_the_row_groups_left(tmp_path: Path) -> None:
    """A loader restored at epoch 1, batch 9 fetches no row group of the windows before its
    position (the read-ahead included); the batches equal the uninterrupted loader's. (The
    shards in memory://, fsspec's in-process store: its listing and its files' details say
    their times differently, which once read as a changed shard.)"""
    import fsspec

    fsspec.filesystem("memory").put(
        str(write_shards(tmp_path / "d")) + "/", "/resume/", recursive=True
    )
    config = DataConfig(name="parquet", path="memory://resume/", shuffle_window=2)
    data = shard_data(config)
    straight = ResumableLoader(data.train, batch_size=8, seed=5)
    next(iter(straight))  # (epoch 0 begun)
    straight.epoch, straight.batches_consumed = 1, 0
    expected = [b[1].tolist() for b in straight]
    fetched: list[int] = []
    real = ShardSet.read

    def read(self: ShardSet, unit: int, columns: list[str]) -> Any:
        fetched.append(unit)
        return real(self, unit, columns)

    again = shard_data(config)  # a new process's: its own cache
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardSet, "read", read)
        resumed = ResumableLoader(again.train, batch_size=8, seed=5)
        resumed.load_state_dict({"epoch": 1, "batches_consumed": 9})
        sampler = resumed.sampler
        sampler.epoch = 1
        windows = sampler.windows()
        got = [b[1].tolist() for b in resumed]
    assert got == expected[9:]
    at = 9 * 8  # the first sample left, and the window it is in
    ends = np.cumsum([again.train.counts[u].sum() for u in windows])
    current = int(np.searchsorted(ends, at, side="right"))
    passed = {int(u) for w in windows[:current] for u in w}
    assert passed and fetched and not passed & set(fetched), (passed, fetched)
    # A shard rewritten between the run and its resume: refused, never a mix of two versions.
    saved = resumed.state_dict()
    memory = fsspec.filesystem("memory")
    memory.pipe("/resume/part-00002.parquet", memory.cat("/resume/part-00001.parquet"))
    with pytest.raises(glassloop.DataError, match="are not those the run trained on"):
        ResumableLoader(shard_data(config).train, batch_size=8).load_state_dict(saved)


def test_a_bucket_of_shards_resumes_bitwise_and_a_bad_shard_is_one_line(tmp_path: Path) -> None:
    """Shards in a bucket of a real S3 server on 127.0.0.1, read by loader workers: killed
    with SIGKILL after step 11 and resumed in a new process, the final weights, optimizer
    state and every reported number equal the straight run's (verify-resume). Then each bad
    shard is one line naming it, exit 2: not Parquet, truncated, a page that fails its checksum, a
    missing column, one deleted or rewritten after the run listed it, a bucket that refuses."""
    local = write_shards(tmp_path / "d")
    with local_s3("data") as env:
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.put(str(local) + "/", "data/train/", recursive=True)
        common = ["data.name=parquet", "data.path=s3://data/train/", "data.num_workers=2",
                  "data.batch_size=16", "data.shuffle_window=2", "model.hidden=[8]",
                  "train.epochs=2", "checkpoint.every_n_steps=3", "train.progress=none"]  # fmt: skip
        done = run_glassloop("verify-resume", *sets(common), "--kill-at", "11", cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "identical" in done.stdout, done.stdout
        good = (local / "part-00001.parquet").read_bytes()
        damaged = bytearray(good)
        damaged[300] ^= 0x40  # (in a data page of the first row group)
        cases = {
            b"not parquet at all": "is not a readable Parquet file",
            good[: len(good) // 2]: "is not a readable Parquet file",  # (truncated)
            bytes(damaged): "row group 0 cannot be decoded",
            pq_bytes(pa.table({"a": [1.0, 2.0], "label": [0, 1]})): "has no column 'b'",
        }
        for content, message in cases.items():
            fs.pipe("data/train/part-00001.parquet", content)
            refused = run_glassloop("train", *sets(common), cwd=tmp_path)
            assert_one_line(refused, "'s3://data/train/part-00001.parquet'", message)
        fs.pipe("data/train/part-00001.parquet", good)
        # Changed under the run: listed with one version, read as another, or gone.
        from glassloop.config.assemble import build
        from glassloop.config.schema import load_config

        cfg = load_config(None, [*common, "data.num_workers=0"])
        for change, message in ((lambda: fs.pipe("data/train/part-00003.parquet", good),
                                 "changed during the run"),
                                (lambda: fs.rm("data/train/part-00003.parquet"), "is gone")):  # fmt: skip
            run = build(cfg, run_dir=tmp_path / "changed")
            change()
            with pytest.raises(glassloop.DataError, match=message) as refused:
                run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
            assert "'s3://data/train/part-00003.parquet'" in str(refused.value)
            assert "\n" not in str(refused.value)
        fs.put(str(local / "part-00003.parquet"), "data/train/part-00003.parquet")
        fs.rm("data", recursive=True)  # a bucket that is not there: its driver's words
        refused = run_glassloop("train", *sets(common), cwd=tmp_path)
        assert_one_line(refused, "'s3://data/train/'")
    assert env["AWS_SECRET_ACCESS_KEY"] not in done.stdout + done.stderr


def pq_bytes(table: Any) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue().to_pybytes())


def assert_one_line(done: Any, *parts: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr + done.stdout
    for part in parts:
        assert part in lines[0], lines[0]


def test_ten_times_the_cache_trains_within_it(tmp_path: Path) -> None:
    """A data set of about 10 MB decoded trains with data.cache_mb = 1 (a window of two row
    groups: 0.2 MB): the cache folder never holds more than the budget and a window, and it
    is gone when the process ends (here: at the end of the test, removed by hand)."""
    folder = tmp_path / "big"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(10):  # 10 shards of 14,000 rows x 8 float64 columns: ~0.8 MB each
        x = rng.normal(size=(14_000, 8))
        columns = {f"f{j}": x[:, j] for j in range(8)}
        pq.write_table(pa.table({**columns, "label": (x[:, 0] > 0).astype(np.int64)}),
                       folder / f"{i}.parquet", row_group_size=1_400)  # fmt: skip
    peak = []

    class Watch(glassloop.Callback):
        def on_step_end(self, trainer: Any, step: int, loss: Any) -> None:
            if step % 20 == 0:
                cached = (tmp_path / "cache" / "shards").rglob("*.arrow")
                peak.append(sum(p.stat().st_size for p in cached))

    from glassloop.config.assemble import build
    from glassloop.config.schema import load_config

    cfg = load_config(None, [f"data.path={folder}", "data.name=parquet", "data.cache_mb=1",
                             "data.shuffle_window=2", "data.batch_size=256", "train.epochs=1",
                             "model.hidden=[8]", "train.progress=none"])  # fmt: skip
    run = build(cfg, run_dir=tmp_path / "run")
    run.trainer.callbacks.append(Watch())
    history = run.trainer.fit(run.train_loader, run.val_loader, epochs=1)
    total = sum(u[3] for u in run.train_loader.dataset.shards.units)
    assert total > 10 * 2**20 and max(peak) <= 2**20 + 2 * 110_000, (total, peak)
    assert history[-1]["val_accuracy"] > 0.9
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
