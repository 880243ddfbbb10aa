"""Every benchmark in one table (run by hand; results in docs/benchmarks.md).

    .venv/bin/python benchmarks/run_all.py          # peers are skipped when not installed
    .venv-bench/bin/python benchmarks/run_all.py    # with Lightning, Fabric, Accelerate, Keras

Rows: glassloop's step cost vs the hand-written loop and the framework peers (marginal µs per
step, same in-memory batches), the fast in-memory loader vs DataLoader, time to 95%
validation accuracy on the bundled MNIST subset, checkpoint save/load time and size, and the
start-up time of ``glassloop --help`` and ``glassloop train`` (to its first logged step).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import peers

from glassloop import build, load_config
from glassloop.checkpoint.resume import check_training_state
from glassloop.data import InMemoryLoader
from glassloop.run_dir.checkpoints import read_checkpoint
from glassloop.storage.weights import load_weights

ROWS: list[tuple[str, str, str]] = []


def row(name: str, value: str, target: str = "") -> None:
    ROWS.append((name, value, target))
    print(f"  {name}: {value}", flush=True)


def step_costs() -> None:
    for kind, target in (("mlp", "<= 1.03"), ("linear", "<= 1.10")):
        costs = peers.marginal_steps(kind, reps=5)
        base = costs["hand-written"]
        label = "tutorial MLP" if kind == "mlp" else "Linear(784,10)"
        for name, cost in costs.items():
            if name != "hand-written":
                goal = target if name == "glassloop" else "slower than glassloop"
                row(f"{label}: {name} / hand-written", f"{cost / base:.2f}", goal)


def loader_speed() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60_000, 1, 28, 28, generator=g), torch.randint(0, 10, (60_000,), generator=g)
    slow = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=g)
    fast = InMemoryLoader((x, y), batch_size=64, shuffle=True)
    times: dict[str, list[float]] = {"slow": [], "fast": []}
    for _ in range(3):
        for name, loader in (("slow", slow), ("fast", fast)):
            start = time.perf_counter()
            for _batch in loader:
                pass
            times[name].append(time.perf_counter() - start)
    ratio = statistics.median(times["slow"]) / statistics.median(times["fast"])
    row("fast in-memory loader vs DataLoader (batches/s)", f"{ratio:.1f}x", ">= 5x")


def time_to_accuracy(tmp: Path) -> None:
    cfg = load_config(None, ["train.progress=none"])
    run = build(cfg, run_dir=tmp / "tta")
    history = run.trainer.fit(run.train_loader, run.val_loader, epochs=cfg.train.epochs)
    elapsed = 0.0
    for epoch in history:
        elapsed += epoch["seconds"]
        if epoch["val_accuracy"] >= 0.95:
            row("time to 95% val accuracy (bundled MNIST, default run)",
                f"{elapsed:.1f} s (epoch {epoch['epoch']})")  # fmt: skip
            break
    else:
        best = max(e["val_accuracy"] for e in history)
        row(
            "time to 95% val accuracy (bundled MNIST, default run)",
            f"not reached (best {best:.1%})",
        )
    trainer = run.trainer
    saves, loads = [], []
    path = None
    for _ in range(5):
        start = time.perf_counter()
        path = trainer.checkpointer.save()  # fit handed it its parts
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert path is not None
        checkpoint = read_checkpoint(path, check_training_state)
        load_weights(trainer.model, checkpoint.weights)
        trainer.load_state_dict(checkpoint.state)
        loads.append(time.perf_counter() - start)
    assert path is not None
    size = sum(p.stat().st_size for p in path.iterdir())
    row("checkpoint of the default run: size", f"{size / 2**20:.2f} MiB")
    row("checkpoint save / load+verify", f"{1e3 * statistics.median(saves):.0f} ms / "
        f"{1e3 * statistics.median(loads):.0f} ms")  # fmt: skip


def startup(tmp: Path) -> None:
    helps = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "glassloop", "--help"], capture_output=True, check=True
        )
        helps.append(time.perf_counter() - start)
    row("glassloop --help", f"{statistics.median(helps):.2f} s")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "glassloop", "train", "--set", "train.progress=lines",
         "--set", "train.epochs=1", "--run-dir", str(tmp / "startup")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("loss:"):
            first = time.perf_counter() - start
    proc.wait()
    row("glassloop train: launch to first logged step", f"{first:.2f} s")


def main() -> None:
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        step_costs()
        loader_speed()
        time_to_accuracy(Path(tmp))
        startup(Path(tmp))
    width = max(len(r[0]) for r in ROWS)
    print(f"\n{'benchmark':<{width}}  {'value':<18}  target")
    for name, value, target in ROWS:
        print(f"{name:<{width}}  {value:<18}  {target}")


if __name__ == "__main__":
    main()
