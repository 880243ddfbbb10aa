"""Two processes on CPU (gloo) through torchrun: DDP equals one process, faults do not hang,
and a two-process run resumes bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from cli_runner import run_glassloop
from safetensors.torch import load_file

from glassloop.step.throughput import TIMING

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_distributed")

KILLABLE = Path(__file__).parents[1] / "killable_model.py"  # copied next to the config

# 640 training samples = 20 global batches of 32 per epoch (16 per process with 2 processes).
CONFIG = """
[data]
name = "synthetic"
num_samples = 800
batch_size = 16
[model]
hidden = [32]
[scheduler]
interval = "step"
[train]
epochs = 2
progress = "none"
dist_timeout_s = 30
"""


def train(
    cwd: Path, *args: str, nproc: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``glassloop train cfg.toml ARGS`` in a new process (forked: tests/forkserver.py), which
    starts torchrun and its ``nproc`` workers, each a new interpreter."""
    launch = ["--nproc", str(nproc)] if nproc else []
    return forkserver.run(
        [sys.executable, "-m", "glassloop", "train", "cfg.toml", *launch, *args],
        cwd=cwd,
        timeout=180,
        # PYTHONFAULTHANDLER: a worker that aborts in C++ (gloo) prints every thread's
        # Python stack, so a failure here says where it happened.
        env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},
    )


def train_here(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``glassloop train cfg.toml ARGS`` in this process (:func:`cli_runner.run_glassloop`):
    for the one-process baselines and the refusals, which need no process of their own
    (a subprocess costs an interpreter, a torch import and torch._dynamo's: ~6 s of CPU)."""
    return run_glassloop("train", "cfg.toml", *args, cwd=cwd)


def last_epoch(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == "epoch"][-1]


def epoch_rows(run: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == "epoch"]


def step_rows(run: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["kind"] == "step"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ddp")
    (path / "cfg.toml").write_text(CONFIG)
    shutil.copy(KILLABLE, path / "killable.py")
    return path


def test_two_processes_equal_one_process_with_the_same_global_batch(workdir: Path) -> None:
    # log_every=1: a logged step once reduced the step loss in place, doubling it in the
    # epoch's train_loss (2.3256 vs 1.1628 on digits).
    two = train(workdir, "--run-dir", "two", "--set", "train.log_every=1", nproc=2)
    assert two.returncode == 0, two.stderr
    one = train_here(workdir, "--run-dir", "one", "--set", "data.batch_size=32",
                     "--set", "train.log_every=1")  # fmt: skip
    assert one.returncode == 0, one.stderr
    a, b = (
        load_file(workdir / "one" / "model.safetensors"),
        load_file(workdir / "two" / "model.safetensors"),
    )
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-7), key
    ra, rb = last_epoch(workdir / "one"), last_epoch(workdir / "two")
    assert ra["val_accuracy"] == rb["val_accuracy"]  # every validation sample counted once
    assert ra["val_loss"] == pytest.approx(rb["val_loss"], abs=1e-6)
    assert ra["samples"] == rb["samples"] == 1280
    assert not (workdir / "two" / "checkpoints" / ".tmp").exists()
    # A step row's loss is the whole step's (every process's samples), as one process logs it.
    sa, sb = step_rows(workdir / "one"), step_rows(workdir / "two")
    assert [r["step"] for r in sa] == [r["step"] for r in sb] and sa
    for a, b in zip(sa, sb, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # Every number of every epoch row too (what history, early stopping and plateau read).
    for a, b in zip(epoch_rows(workdir / "one"), epoch_rows(workdir / "two"), strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - {"kind", *TIMING}:
            assert a[key] == pytest.approx(b[key], rel=1e-5), key


def test_micro_batches_that_fit_are_settled_alike_when_one_process_runs_out_of_memory(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2 processes x batch 8 x 2 accumulation steps = one process with batch 32, also with
    micro_batch_size = "auto" when only rank 0 runs out of memory above 4 rows: both settle
    on 4 (a plan of their own would leave rank 1 waiting in rank 0's missing reduction: a
    hang), and the weights are the one-process run's to fp32 rounding."""
    model = ("--set", "model.target=killable.py:KillableMLP")
    monkeypatch.setenv("DROPOUT", "0")  # (the comparison needs the same masks: none)
    split = ("--set", "data.batch_size=8", "--set", "train.grad_accum_steps=2")
    auto = train(workdir, "--run-dir", "auto", *model, *split, "--set",
                 "train.micro_batch_size=auto", nproc=2,
                 env={"OOM_ABOVE": "4", "OOM_RANK": "0"})  # fmt: skip
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.count("micro-batches: 8 rows did not fit in memory; each batch of 8 "
                             "is now 2 micro-batches of at most 4 rows") == 1, auto.stdout  # fmt: skip
    state = json.loads((workdir / "auto" / "checkpoints" / "step-00000040" / "state.json")
                       .read_text())  # fmt: skip
    assert state["micro_batches"] == {"rows": 4}
    whole = train_here(workdir, "--run-dir", "whole", *model, "--set", "data.batch_size=32")
    assert whole.returncode == 0, whole.stderr
    a, b = (
        load_file(workdir / "whole" / "model.safetensors"),
        load_file(workdir / "auto" / "model.safetensors"),
    )
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6), key


def test_a_dead_process_fails_the_job_without_hanging(workdir: Path) -> None:
    start = time.monotonic()
    result = train(
        workdir,
        "--run-dir",
        "dead",
        "--set",
        "model.target=killable.py:KillableMLP",
        nproc=2,
        env={"KILL_RANK": "1", "KILL_AT_FORWARD": "5"},
    )
    # 128 + SIGKILL, as a shell says (docs/exit-codes.md): a job scheduler restarts a killed
    # job and fails a crashed one; it was 1, the other worker's error after the kill.
    assert result.returncode == 128 + signal.SIGKILL, result.stderr[-2000:]
    assert time.monotonic() - start < 90


def test_a_worker_killed_under_torchrun_restarts_and_resumes_by_itself_bitwise(
    workdir: Path,
) -> None:
    """torchrun's elastic restarts (``--max-restarts``): rank 0 is SIGKILLed in the middle of
    step 27 (its first attempt only), torchrun restarts both processes with the same command
    line, which has no --resume, and they go on from the newest checkpoint by themselves
    (TORCHELASTIC_RESTART_COUNT); the end equals the uninterrupted run's, bit for bit."""
    common = (
        "--set",
        "model.target=killable.py:KillableMLP",
        "--set",
        "checkpoint.every_n_steps=4",
        "--set",
        "train.loss_spike=1000",  # on (it never fires here): its window is resumed too
    )
    reference = train(workdir, "--run-dir", "ref", *common, nproc=2)
    assert reference.returncode == 0, reference.stderr
    elastic = forkserver.run(  # (torchrun forked; its workers new interpreters)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=3", "-m", "glassloop", "train", "cfg.toml", "--run-dir", "cut", *common],
        cwd=workdir, timeout=180, env={**os.environ, "KILL_RANK": "0", "KILL_AT_FORWARD": "27"},
    )  # fmt: skip
    assert elastic.returncode == 0, elastic.stderr
    assert (
        "resumed from 'cut/checkpoints/step-00000024' at step 24 (epoch 2, batch 4)"
        in elastic.stdout
    )
    for name in ("model.safetensors", "checkpoints/step-00000040/state.safetensors"):
        a, b = load_file(workdir / "ref" / name), load_file(workdir / "cut" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    # Each process's loss-spike window (the last 20 losses it checked) as uninterrupted.
    windows = [json.loads((workdir / run / "checkpoints/step-00000040/state.json").read_text())
               ["loss_spike"] for run in ("ref", "cut")]  # fmt: skip
    assert windows[0] == windows[1] and len(windows[0]) == 2
    assert len(windows[0][0]["recent"]) == 20 and windows[0][0] != windows[0][1]


def test_dataparallel_is_refused_with_the_reason(workdir: Path) -> None:
    result = train_here(workdir, "--run-dir", "dp", "--set", "train.strategy=dp")
    assert result.returncode == 2
    assert "GPU 0 becomes the bottleneck" in result.stderr and "torchrun" in result.stderr


def test_a_stop_signal_to_the_launcher_checkpoints_one_consistent_step(workdir: Path) -> None:
    """SIGUSR1 (Slurm's early warning) to the launcher: passed on as SIGTERM (torchrun would
    die of SIGUSR1 and leave the workers unsaved), which torchrun forwards to both ranks
    (SIGTERM itself takes the same path, unchanged)."""
    import signal

    proc = forkserver.Popen(
        [sys.executable, "-m", "glassloop", "train", "cfg.toml", "--nproc", "2", "--run-dir", "term",
         "--set", "train.log_every=1", "--set", "train.progress=lines"],
        cwd=workdir,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = 0
    for line in proc.stdout:
        lines += line.startswith("loss:")
        if lines == 10:
            proc.send_signal(signal.SIGUSR1)  # to the launcher: SIGTERM to torchrun, to ranks
            break
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr  # the workers' code, as in one process (128 + 15)
    root = workdir / "term" / "checkpoints"
    latest = (root / "latest").read_text().strip()
    meta = json.loads((root / latest / "meta.json").read_text())
    assert meta["world_size"] == 2 and 10 <= meta["step"] < 40
    # (a refusal through the launcher is 2, not torchrun's 1: test_fsdp's corrupt shard)
    resumed = train(workdir, "--run-dir", "term", "--resume", nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {meta['step']}" in resumed.stdout
    assert last_epoch(workdir / "term")["step"] == 40


def test_kill_9_of_the_launcher_takes_torchrun_and_the_workers_with_it(workdir: Path) -> None:
    """They used to go on headless (re-parented), holding the run directory's lock and
    finishing the run alone, racing a scheduler's restart of the command."""
    import signal

    proc = forkserver.Popen(
        [sys.executable, "-m", "glassloop", "train", "cfg.toml", "--nproc", "2", "--run-dir",
         "orphans", "--set", "train.log_every=1", "--set", "train.progress=lines",
         "--set", "train.epochs=50"],
        cwd=workdir, stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: whatever is left of it is found below
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("loss:"):  # both workers are training
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anything of the group still alive?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("torchrun or a worker outlived the launcher")
    from glassloop.run_dir.lock import RunLock

    with RunLock(workdir / "orphans"):  # no one holds the run directory any more
        pass


SHARDS = """
import json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import glassloop
from glassloop.data import make_loader
from glassloop.errors import DataError

class Seen(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.seen = nn.Linear(2, 3), []
    def forward(self, x):
        if self.training:  # (the first-batch check's forward is in eval mode)
            self.seen += x[:, 0].int().tolist()
        return self.net(x)

x = torch.stack([torch.arange(40.0), torch.randn(40)], 1)
y = torch.randint(0, 3, (40,))
data, model = TensorDataset(x, y), Seen()
trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                            nn.CrossEntropyLoss(), device="cpu", progress="none")
refused = []
for loader in DataLoader(data, batch_size=4, shuffle=True), make_loader((x, y), batch_size=4):
    try:
        trainer.fit(loader, epochs=1)
    except DataError as err:
        refused.append(str(err))
world = trainer.world
sampler = DistributedSampler(data, num_replicas=world.size, rank=world.rank, shuffle=True)
trainer.fit(DataLoader(data, batch_size=4, sampler=sampler), epochs=2)
out = {"refused": refused, "seen": [model.seen[:20], model.seen[20:]], "steps": trainer.state.step}
with open(f"{sys.argv[1]}-{world.rank}.json", "w") as handle:
    json.dump(out, handle)
"""


def test_each_process_trains_on_its_own_shard_or_the_loader_is_refused(tmp_path: Path) -> None:
    """Under torchrun, a training loader that would give each of 2 processes every sample (a
    DataLoader without a DistributedSampler, a glassloop loader built without ``world=``) is
    refused in one line saying what to pass; a ``DistributedSampler`` gives each its half,
    another order each epoch (its epoch set by ``fit``)."""
    script = tmp_path / "shards.py"
    script.write_text(SHARDS, encoding="utf-8")
    done = forkserver.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(tmp_path / "rank")],
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        dataloader, ours = rank["refused"]
        assert dataloader.startswith("data: the training DataLoader samples the whole dataset")
        assert "each of the 2 processes would train on all of it" in dataloader
        assert "sampler=DistributedSampler(dataset, num_replicas=trainer.world.size" in dataloader
        assert "built for 1 process(es) and this job has 2" in ours
        assert "make_loader(..., world=trainer.world)" in ours
        assert rank["steps"] == 10  # 20 samples a process, batches of 4, 2 epochs
        assert rank["seen"][0] != rank["seen"][1]  # set_epoch: another order each epoch
    for epoch in (0, 1):
        halves = [set(rank["seen"][epoch]) for rank in ranks]
        assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(40))
