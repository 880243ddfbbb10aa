"""Resume at another number of processes with the same sample stream (issue 35, item 2): a run
stopped at 2 processes, resumed at 1, stopped again, finished at 3 (gloo on CPU, torchrun),
fed by glassloop's own loader (DDP and FSDP2), by Parquet shards streamed by glassloop's
shard reader (issue 60: a window of row groups at a time) and by a ``DataLoader`` over a
``DistributedSampler``. Every step trains on the same global batch as the one-process run's,
so each epoch sees every sample once, and the weights and every reported number equal that
run's to fp32 rounding (the gradients add up in another order). The first stops are SIGTERMs
to rank 0 alone inside a validation: the processes agree to abandon it."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import forkserver
import pytest
from safetensors.torch import load_file

from glassloop.step.throughput import TIMING

SCRIPT = Path(__file__).with_name("elastic_script.py")
KINDS = ("glassloop", "fsdp", "shards", "dataloader")


def launch(root: Path, name: str, processes: int, *stops: str) -> str:
    """One launch of the script (torchrun for several processes); its stdout."""
    runner = [sys.executable]
    if processes > 1:
        runner += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    result = forkserver.run(  # (forked: tests/forkserver.py; torchrun's workers new interpreters)
        [*runner, str(SCRIPT), str(root), name, *stops],
        timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def reference(root: Path) -> None:
    """The uninterrupted one-process runs (in this process): batch 24."""
    spec = importlib.util.spec_from_file_location("elastic_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write_shards(root.parent)
    for kind in KINDS:
        assert script.train(root, kind, "ref", "none", start_batch=24) == "finished"


def steps_seen(
    root: Path, kind: str, launches: tuple[str, ...]
) -> dict[int, tuple[int, list[int]]]:
    """Each step's epoch and sample ids over every process, from the last launch that ran it."""
    seen: dict[int, tuple[int, list[int]]] = {}
    for name in launches:
        steps: dict[int, list[dict[str, Any]]] = {}
        for path in root.glob(f"seen-{kind}-{name}-*.json"):
            for record in json.loads(path.read_text()):
                steps.setdefault(record["step"], []).append(record)
        for step, records in steps.items():
            seen[step] = (records[0]["epoch"], sorted(i for r in records for i in r["ids"]))
    return seen


def numbers(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in row.items() if k not in TIMING}
        for row in rows
        if row["kind"] in ("epoch", "val", "losses")  # (losses: every step's, the report's)
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun with gloo")
def test_two_then_one_then_three_processes_keep_the_global_batch_and_the_sample_stream(
    tmp_path: Path,
) -> None:
    reference(tmp_path / "ref")
    cut = tmp_path / "cut"
    first = launch(cut, "a", 2, "glassloop=validation:2", "fsdp=validation:3", "shards=step:7",
                   "dataloader=step:6")  # fmt: skip
    assert "glassloop: stopped after step 8, owed 'step'" in first  # step 8's validation
    assert "fsdp: stopped after step 10, owed 'epoch'" in first  # epoch 1's
    second = launch(cut, "b", 1, "glassloop=step:13", "fsdp=step:11", "shards=step:14",
                    "dataloader=step:12")  # fmt: skip
    for kind in KINDS:
        assert f"{kind}: stopped after step" in second
    assert "(written by 2 process(es)) with 1" in second
    assert "the global batch 24 is kept (24 per process)" in second
    third = launch(cut, "c", 3, *(f"{kind}=none" for kind in KINDS))
    assert "the global batch 24 is kept (8 per process)" in third
    assert third.count("finished") == 3 * len(KINDS)  # (every process says so)

    for kind in KINDS:
        straight, resumed = (
            steps_seen(tmp_path / "ref", kind, ("ref",)),
            steps_seen(cut, kind, ("a", "b", "c")),
        )
        assert resumed == straight, kind  # every step: the same global batch's samples
        for epoch in (1, 2):  # each sample once per epoch
            ids = Counter(i for e, step in resumed.values() if e == epoch for i in step)
            assert ids == Counter(range(240)), (kind, epoch)
        a = load_file(tmp_path / "ref" / kind / "model.safetensors")
        b = load_file(cut / kind / "model.safetensors")
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert worst < 1e-6, (kind, worst)  # measured: 6e-8
        # each step's loss in the epochs' "losses" rows: its step row's, to the bit, whatever
        # the number of processes that wrote either (float64 sums: any order adds up alike)
        logged = [json.loads(line) for line in (cut / kind / "metrics.jsonl").open()]
        every = {
            row["first_step"] + i: loss
            for row in logged
            if row["kind"] == "losses"
            for i, loss in enumerate(row["loss"])
        }
        steps = [row for row in logged if row["kind"] == "step"]
        assert steps and all(every[row["step"]] == row["loss"] for row in steps), kind
        rows_a, rows_b = numbers(tmp_path / "ref" / kind), numbers(cut / kind)
        assert [(r["kind"], r["step"]) for r in rows_a] == [(r["kind"], r["step"]) for r in rows_b]
        for row_a, row_b in zip(rows_a, rows_b, strict=True):
            assert row_a.keys() == row_b.keys(), kind
            for key, value in row_a.items():
                if isinstance(value, (float, list)):  # (a list: an epoch's every step loss)
                    assert value == pytest.approx(row_b[key], rel=1e-5, abs=1e-7), (kind, key)
                else:
                    assert value == row_b[key], (kind, key)
