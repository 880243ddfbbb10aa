"""FSDP2 (train.strategy = "fsdp") on CPU with gloo: two sharded processes equal one process,
a kill -9 resumes bit for bit with the same number of processes, a checkpoint reshards to
another number of processes, accumulation syncs once per step, and export gathers the
shards. Checkpoints hold no pickle."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from cli_runner import run_glassloop, run_group
from safetensors.torch import load_file
from test_distributed import CONFIG as DDP_CONFIG
from test_distributed import KILLABLE, last_epoch, train, train_here

from glassloop.run_dir.checkpoints import read_checkpoint

# Its tests share module fixtures: one worker of `make test` runs them all, in order.
pytestmark = pytest.mark.xdist_group("test_fsdp")

# The DDP tests' config (20 global batches of 32 per epoch), sharded.
CONFIG = DDP_CONFIG + 'strategy = "fsdp"\n'


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fsdp")
    (path / "cfg.toml").write_text(CONFIG)
    shutil.copy(KILLABLE, path / "killable.py")
    return path


def close(a: Path, b: Path, atol: float = 1e-6) -> None:
    x, y = load_file(a), load_file(b)
    assert sorted(x) == sorted(y)
    for key in x:
        assert torch.allclose(x[key], y[key], rtol=1e-5, atol=atol), key


@pytest.fixture(scope="module")
def two(workdir: Path) -> Path:
    """A finished two-process FSDP run (2 epochs, 40 steps, a checkpoint per epoch)."""
    result = train(workdir, "--run-dir", "two", nproc=2)
    assert result.returncode == 0, result.stderr
    return workdir / "two"


@pytest.fixture(scope="module")
def one(workdir: Path) -> Path:
    """The same run in one process (in this one), unsharded, with the global batch (32)."""
    done = train_here(workdir, "--run-dir", "one", "--set", "data.batch_size=32",
                      "--set", "train.strategy=auto")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return workdir / "one"


def test_two_sharded_processes_equal_one_process(one: Path, two: Path) -> None:
    close(one / "model.safetensors", two / "model.safetensors")
    ra, rb = last_epoch(one), last_epoch(two)
    assert ra["val_accuracy"] == rb["val_accuracy"]  # every validation sample once
    assert ra["val_loss"] == pytest.approx(rb["val_loss"], abs=1e-6)


def test_activation_checkpointing_inside_sharded_units_trains_bitwise_the_same(
    workdir: Path, two: Path
) -> None:
    """train.activation_checkpointing under FSDP: each unit's activations recomputed in its
    backward, between its all-gather and its reshard; the weights bitwise the same."""
    ac = train(workdir, "--run-dir", "ac", "--set", 'train.activation_checkpointing=["Linear"]',
               nproc=2)  # fmt: skip
    assert ac.returncode == 0, ac.stderr
    x, y = load_file(workdir / "ac" / "model.safetensors"), load_file(two / "model.safetensors")
    assert sorted(x) == sorted(y)
    assert all(torch.equal(x[key], y[key]) for key in x)


def test_a_sharded_checkpoint_is_one_safetensors_file_per_process_and_no_pickle(
    two: Path,
) -> None:
    checkpoint = two / "checkpoints" / "step-00000040"
    shards = sorted(p.name for p in (checkpoint / "shards").iterdir())
    assert len(shards) == 2 and all(name.endswith(".safetensors") for name in shards)
    assert not (checkpoint / "model.safetensors").exists()  # the weights are the shards
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert {f"shards/{name}" for name in shards} <= set(manifest["files"])
    for file in checkpoint.rglob("*"):  # DCP's default writer would add a pickled .metadata
        if file.is_file() and file.name != ".glassloop":
            assert file.suffix in (".json", ".safetensors"), file
    # Each process holds half of every sharded weight (rows split in two).
    halves = [load_file(checkpoint / "shards" / name) for name in shards]
    full = load_file(two / "model.safetensors")
    assert (
        halves[0]["model.1.weight"].shape[0] + halves[1]["model.1.weight"].shape[0]
        == (full["1.weight"].shape[0])
    )


def test_export_gathers_the_shards_into_the_final_weights(workdir: Path, two: Path) -> None:
    from glassloop import load_model
    from glassloop.tools.export import export_model

    out = export_model(two / "checkpoints" / "step-00000040", workdir / "exported.safetensors")
    a, b = load_file(out), load_file(two / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert isinstance(load_model(out), torch.nn.Module)  # it describes its model


def test_accumulation_with_fsdp_equals_one_process(workdir: Path, one: Path) -> None:
    # 2 processes x batch 8 x 2 micro-batches (gradients reduced on the second only)
    two = train(workdir, "--run-dir", "two-accum", "--set", "data.batch_size=8",
                "--set", "train.grad_accum_steps=2", nproc=2)  # fmt: skip
    assert two.returncode == 0, two.stderr
    close(one / "model.safetensors", workdir / "two-accum" / "model.safetensors")


def test_kill_and_resume_with_the_same_processes_is_bitwise(workdir: Path) -> None:
    common = ("--set", "model.target=killable.py:KillableMLP",
              "--set", "checkpoint.every_n_steps=4")  # fmt: skip
    reference = train(workdir, "--run-dir", "ref", *common, nproc=2)
    assert reference.returncode == 0, reference.stderr
    # Rank 1 killed in step 27 (its first attempt only); torchrun's elastic restart goes on
    # from the newest checkpoint by itself (one launch: the kill and the resume).
    resumed = forkserver.run(  # (torchrun forked; its workers new interpreters)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=3", "-m", "glassloop", "train", "cfg.toml", "--run-dir", "cut", *common],
        cwd=workdir, timeout=180, env={**os.environ, "KILL_RANK": "1", "KILL_AT_FORWARD": "27"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from 'cut/checkpoints/step-00000024' at step 24" in resumed.stdout
    a, b = (
        load_file(workdir / "ref" / "model.safetensors"),
        load_file(workdir / "cut" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)  # dropout too: each process's RNG resumed
    for name in ("shard-00001-model-00001-of-00001.safetensors",
                 "shard-00002-model-00001-of-00001.safetensors"):  # fmt: skip
        shard = Path("checkpoints/step-00000040/shards") / name
        x, y = load_file(workdir / "ref" / shard), load_file(workdir / "cut" / shard)
        assert all(torch.equal(x[k], y[k]) for k in x)  # weights and optimizer state


# torchrun's worker: rank 0 SIGKILLed once (a marker file) after every process's shards of
# step 24 are written by the background save and before its commit: the moment between.
KILL_BEFORE_COMMIT = """
import os, signal, sys
from pathlib import Path
import glassloop.checkpoint.background as background
from glassloop.cli.main import main

real = background.BackgroundSave._commit_after_shards

def commit_after_shards(self, commit, snap):
    self._written()
    if snap.step == 24 and not Path("killed-once").exists():
        Path("killed-once").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, commit, snap)

background.BackgroundSave._commit_after_shards = commit_after_shards
sys.exit(main(sys.argv[1:]))
"""


def test_background_saves_of_shards_commit_after_every_process_and_resume_bitwise(
    workdir: Path,
) -> None:
    """checkpoint.async_save with FSDP: each process's shards are copied and written in the
    background (DCP's async_save over the checkpoints' own gloo group) and rank 0 commits only
    once all are written. Rank 0 killed between the shards and the commit of step 24: the
    newest checkpoint is still step 20, torchrun's restart resumes from it, and the weights
    and every shard end bitwise those of the synchronous run."""
    common = ("--set", "model.target=killable.py:KillableMLP",
              "--set", "checkpoint.every_n_steps=4")  # fmt: skip
    if not (workdir / "ref" / "model.safetensors").is_file():  # (the sync test's reference)
        assert train(workdir, "--run-dir", "ref", *common, nproc=2).returncode == 0
    (workdir / "kill_before_commit.py").write_text(KILL_BEFORE_COMMIT)
    resumed = run_group(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=3", "kill_before_commit.py", "train", "cfg.toml", "--run-dir", "bg",
         *common, "--set", "checkpoint.async_save=true"],
        cwd=workdir, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (workdir / "killed-once").exists()
    assert "resumed from 'bg/checkpoints/step-00000020' at step 20" in resumed.stdout
    a, b = (
        load_file(workdir / "ref" / "model.safetensors"),
        load_file(workdir / "bg" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("shard-00001-model-00001-of-00001.safetensors",
                 "shard-00002-model-00001-of-00001.safetensors"):  # fmt: skip
        shard = Path("checkpoints/step-00000040/shards") / name
        x, y = load_file(workdir / "ref" / shard), load_file(workdir / "bg" / shard)
        assert all(torch.equal(x[k], y[k]) for k in x)  # weights and optimizer state


def test_a_checkpoint_reshards_from_two_processes_to_one_and_back(workdir: Path, two: Path) -> None:
    """Epoch 2 of the two-process run continued by one process, and a one-process run by
    two, each with the config it started with: the run keeps its global batch (32)."""
    one = train(workdir, "--run-dir", "to-one", "--resume", str(two / "checkpoints/step-00000020"))
    assert one.returncode == 0, one.stderr
    assert "(written by 2 process(es)) with 1: the weights and the optimizer state are " \
        "resharded; the global batch 32 is kept (32 per process)" in one.stdout  # fmt: skip
    close(workdir / "to-one" / "model.safetensors", two / "model.safetensors")
    first = train_here(workdir, "--run-dir", "single", "--set", "data.batch_size=32")
    assert first.returncode == 0, first.stderr
    back = train(workdir, "--run-dir", "to-two", "--resume",
                 str(workdir / "single" / "checkpoints/step-00000020"),
                 "--set", "data.batch_size=32", nproc=2)  # fmt: skip
    assert back.returncode == 0, back.stderr
    assert "(written by 1 process(es)) with 2" in back.stdout
    assert "the global batch 32 is kept (16 per process)" in back.stdout
    close(workdir / "to-two" / "model.safetensors", two / "model.safetensors")


def test_a_corrupt_shard_is_refused_in_one_line(workdir: Path, two: Path) -> None:
    """The right reason, but in 46 lines: once per process, then torchrun's traceback and
    its report of a failed job."""
    shutil.copytree(two, workdir / "corrupt")
    for step in ("step-00000020", "step-00000040"):
        shard = next((workdir / "corrupt" / "checkpoints" / step / "shards").glob("*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-10] ^= 1
        shard.write_bytes(bytes(data))
    (workdir / "corrupt" / "model.safetensors").unlink()  # (else: finished, nothing to resume)
    done = train(workdir, "--run-dir", "corrupt", "--resume", "--set", "train.epochs=3", nproc=2)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "fails its SHA-256 check (corrupt or modified)" in lines[0]


def test_bf16_shards_train_and_strategy_mismatches_are_refused(workdir: Path, two: Path) -> None:
    bf16 = train(workdir, "--run-dir", "bf16", "--set", "train.precision=bf16",
                 "--set", "train.epochs=1", "--set", "checkpoint.monitor=val_loss",
                 nproc=2)  # fmt: skip
    assert bf16.returncode == 0, bf16.stderr
    assert last_epoch(workdir / "bf16")["val_loss"] < 2.3  # learned something (ln 10 = 2.30)
    best = read_checkpoint(workdir / "bf16" / "best")  # written sharded too, and verified
    assert best.sharded and len(list((best.path / "shards").iterdir())) == 2
    fp16 = train_here(workdir, "--run-dir", "fp16", "--set", "train.precision=fp16")
    assert fp16.returncode == 2 and "use 'bf16'" in fp16.stderr
    ddp = train_here(workdir, "--run-dir", "two", "--resume", "--set", "train.strategy=ddp",
                     "--allow-config-change")  # fmt: skip  # (refused before the process count)
    assert ddp.returncode == 2 and "resume it with train.strategy = 'fsdp'" in ddp.stderr


PREDICT = """
import sys
import torch
from safetensors.torch import save_file
from torch import nn

import glassloop
from glassloop.data import make_loader
from glassloop.distributed.world import world_from_env

world = world_from_env()
glassloop.seed_everything(0)
x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            nn.CrossEntropyLoss(), strategy="fsdp", progress="none",
                            run_dir=sys.argv[1])
trainer.fit(make_loader((x, y), batch_size=32, shuffle=True, seed=0, world=world), epochs=1)
# Each process predicts its own inputs: rank 0 three batches of 256, rank 1 one batch.
inputs = torch.randn(700 if world.rank == 0 else 10, 6,
                     generator=torch.Generator().manual_seed(world.rank))
probs = trainer.predict(inputs, batch_size=256)
save_file({"inputs": inputs, "probs": probs}, f"{sys.argv[1]}/probs-{world.rank}.safetensors")
# Evaluating 101 samples in batches of 10, rank::2: rank 0 has 6 batches, rank 1 has 5.
xv, yv = torch.randn(101, 6, generator=torch.Generator().manual_seed(7)), torch.arange(101) % 3
shard = make_loader((xv, yv), batch_size=10, shuffle=False, world=world, shard="strided")
loss = trainer.evaluate(shard)["loss"]
save_file({"x": xv, "y": yv, "loss": torch.tensor([loss])}, f"{sys.argv[1]}/eval.safetensors")
"""


def test_each_process_predicts_and_evaluates_its_own_data_with_a_sharded_model(
    tmp_path: Path,
) -> None:
    (tmp_path / "predict.py").write_text(PREDICT)
    done = forkserver.run(  # (torchrun forked; its workers new interpreters)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "predict.py", "run"],
        cwd=tmp_path, timeout=180, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    weights = load_file(tmp_path / "run" / "model.safetensors")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model.load_state_dict(weights)
    for rank, rows in ((0, 700), (1, 10)):
        saved = load_file(tmp_path / "run" / f"probs-{rank}.safetensors")
        assert saved["probs"].shape == (rows, 3)  # no padding forward's rows among them
        expected = torch.softmax(model(saved["inputs"]), dim=1)
        assert torch.allclose(saved["probs"], expected, atol=1e-6)
    # trainer.evaluate on uneven shards: the loss of all 101 samples, as one process has it.
    evaluated = load_file(tmp_path / "run" / "eval.safetensors")
    with torch.no_grad():
        whole = torch.nn.functional.cross_entropy(model(evaluated["x"]), evaluated["y"])
    assert float(evaluated["loss"]) == pytest.approx(whole.item(), rel=1e-5)


def plotted_samples(cwd: Path, sets: list[str], *args: str) -> str:
    """Train a regression; how many validation samples its predicted-vs-true plot shows."""
    run = f"run-{len(list(cwd.glob('run-*')))}"
    command = ["train", *[f"--set={s}" for s in sets], *args, "--run-dir", run]
    if "--nproc" not in args:  # one process: in this one (a process of its own costs ~6 s)
        done = run_glassloop(*command, cwd=cwd)
    else:
        done = forkserver.run([sys.executable, "-m", "glassloop", *command], cwd=cwd, timeout=180)
    assert done.returncode == 0, done.stderr
    page = (cwd / run / "report" / "index.html").read_text()
    return page.split("predicted vs true, ")[1].split(" validation points")[0]


def test_a_regression_plot_has_every_processs_validation_samples(tmp_path: Path) -> None:
    from regression_data import REGRESSION, diabetes_csv

    table = diabetes_csv(tmp_path / "diabetes.csv")
    sets = [f"data.path={table}", *REGRESSION, "train.epochs=1", "train.dist_timeout_s=30"]
    everything = plotted_samples(tmp_path, sets)
    assert int(everything) > 80  # diabetes: 442 rows, a fifth for validation
    # Each of two processes holds half of the validation set; the plot has all of it. (FSDP
    # only: DDP gathers the same way, and each 2-process run costs ~18 s of the suite.)
    assert plotted_samples(tmp_path, [*sets, "train.strategy=fsdp"], "--nproc", "2") == everything
