"""Checkpoint save speed at ~50M and ~200M parameters: glassloop against torch.save, DCP, the disk.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint_speed.py --sizes 50,200 --repeats 3
    # options: --dir /path/on/the/disk (default: here)   --resume (a resume at each size instead)

Each size is a stack of ``nn.Linear(w, w)`` (w = 2048 for 50, 4096 for 200; built with seed 0)
after one Adam step, so the checkpoint holds the weights and Adam's two moments (about 3x the
weights' bytes). The rows are measured in one process, interleaved per repetition (disk,
torch.save, DCP, glassloop sync, glassloop async; again ...), each into a fresh directory
under ``--dir`` (a temporary folder there, removed at the end); the previous row's output is
deleted before each timed run (not timed). Medians over ``--repeats``:

1. disk: the same bytes as the checkpoint's tensors, ``os.write`` of each tensor's memory into
   one file, then ``os.fsync``: what this disk does with nothing else in the way.
2. ``torch.save({"model": ..., "optimizer": ...})`` to one file, flush, ``os.fsync``.
3. DCP: ``torch.distributed.checkpoint.save(..., no_dist=True)`` (one process, no process
   group); its FileSystemWriter fsyncs its own files (``sync_files=True``, the default).
4. glassloop sync: ``glassloop.run_dir.local_store.LocalStore.commit`` (safetensors, fsync of
   every file, SHA-256 manifest, atomic rename of ``checkpoints/step-N``, the ``latest`` pointer).
5. glassloop async: ``Checkpointer(..., CheckpointConfig(async_save=True))``: "blocking" is
   ``save()`` (returns once the state is copied), "total" until ``wait()`` returns (the
   background write committed). Printed as "not available" where glassloop has no async save.

GB/s is 10^9 bytes (the checkpoint's tensor bytes, the same for every row) per second.
``--resume``: instead of the saves, a resume at each size, in fresh Python processes from
their start to their first step (imports, the model and its Adam built, the checkpoint
loaded into both): glassloop's ``Checkpointer.resume`` against a hand ``torch.load`` of one
``torch.save`` file and ``load_state_dict`` of the model and the optimizer, taking turns.
Both files were just written, so they are read from the page cache (a cold read adds the
disk's read time to both). Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from glassloop import Callback, Trainer
from glassloop.checkpoint import background
from glassloop.checkpoint.checkpointer import Checkpointer
from glassloop.options import CheckpointConfig
from glassloop.run_dir.checkpoints import refuse_not_finite
from glassloop.run_dir.local_store import LocalStore
from glassloop.state import TrainState
from glassloop.storage.snapshot import snapshot

ROWS = ("disk", "torch.save", "DCP", "glassloop sync", "glassloop async")
LABELS = {
    "disk": "disk: `os.write` + fsync",
    "torch.save": "`torch.save` + fsync",
    "DCP": "DCP `save` (one process)",
    "glassloop sync": "glassloop `LocalStore.commit`",
}

# A resume in a fresh process, from its start to its first step: the imports, the model and its
# Adam built (default init), the checkpoint loaded into both. "hand": torch.load of one
# torch.save file, then model.load_state_dict and optimizer.load_state_dict; "glassloop":
# Checkpointer.resume (every file's SHA-256 against the manifest, headers, finite weights,
# the training state's checks, then the weights, the optimizer, the RNG and the loop state).
RESUME = """
import json, sys, time
from pathlib import Path
import torch
from torch import nn
how, width, layers, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
if how == "glassloop":
    from glassloop.checkpoint.checkpointer import Checkpointer
    from glassloop.options import CheckpointConfig
    from glassloop.state import TrainState
imported = time.time()
model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
built, cpu = time.time(), time.process_time()
if how == "glassloop":
    checkpointer = Checkpointer(path.parent.parent, CheckpointConfig(), model=model)
    checkpointer.attach({"loop": TrainState(), "optimizer": optimizer})
    checkpointer.resume(path, epochs=2)
    assert checkpointer.state.step == 1
else:
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
assert len(optimizer.state) == 2 * layers
print(json.dumps([imported, built, time.time(), time.process_time() - cpu]))
"""


def shape(millions: int) -> tuple[int, int]:
    """(width, layers) of the Linear stack with about ``millions`` parameters."""
    width = 4096 if millions >= 150 else 2048 if millions >= 30 else 1024
    return width, max(1, round(millions * 1e6 / (width * width + width)))


def build(millions: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its Adam after one step (so the moments exist), seeded."""
    width, layers = shape(millions)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(1, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # (frees the gradients: not part of a checkpoint)
    return model, optimizer


def checkpoint_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [*model.state_dict().values(), *moments]


def write_raw(path: Path, tensors: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in tensors:
            view = tensor.detach().reshape(-1).view(torch.uint8).numpy().data  # its memory
            while view:  # os.write may write less than it was given
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def async_checkpointer(run_dir: Path, model: nn.Module, optimizer: Any) -> Any:
    """A Checkpointer that saves in the background, or None where glassloop has none yet."""
    if "async_save" not in CheckpointConfig.__dataclass_fields__ or not hasattr(
        Checkpointer, "wait"
    ):
        return None
    options: dict[str, Any] = {"async_save": True, "every_n_steps": 1, "keep_last": 1}
    checkpointer = Checkpointer(run_dir, CheckpointConfig(**options), model=model)
    checkpointer.attach({"loop": TrainState(), "optimizer": optimizer})
    return checkpointer


def measure(millions: int, root: Path, repeats: int) -> tuple[Path, int]:
    """Print one size's table; return its last glassloop checkpoint and its byte count."""
    model, optimizer = build(millions)
    tensors = checkpoint_tensors(model, optimizer)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = {name: root / f"{millions}M-{name.replace(' ', '-')}" for name in ROWS}
    checkpointer = async_checkpointer(out["glassloop async"], model, optimizer)
    step = 0
    saved: list[Path] = []

    def glassloop_sync() -> None:
        state = {"optimizer": optimizer.state_dict()}
        refuse_not_finite(out["glassloop sync"], model, step)  # (as the checkpointer's save)
        saved.append(
            LocalStore(out["glassloop sync"]).commit(snapshot(model, state, {"step": step}))
        )

    runs: dict[str, Callable[[], None]] = {
        "disk": lambda: write_raw(out["disk"], tensors),
        "torch.save": lambda: torch_save(out["torch.save"], model, optimizer),
        "DCP": lambda: dcp_save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            checkpoint_id=out["DCP"],
            no_dist=True,
        ),
        "glassloop sync": glassloop_sync,
    }
    times: dict[str, list[float]] = {name: [] for name in [*runs, "blocking", "total"]}
    for rep in range(repeats):
        for name in ROWS:
            step += 1  # a new step directory for every save
            remove(out[name])  # the previous output, not timed
            if name == "glassloop async":
                if checkpointer is None:
                    continue
                out[name].mkdir()  # (a Checkpointer never creates its run directory)
                checkpointer.state.step = step
                start = time.perf_counter()
                checkpointer.save()  # returns once the state is copied
                times["blocking"].append(time.perf_counter() - start)
                checkpointer.wait()  # the background write committed
                times["total"].append(time.perf_counter() - start)
                seconds = times["total"][-1]
            else:
                start = time.perf_counter()
                runs[name]()
                seconds = time.perf_counter() - start
                times[name].append(seconds)
            print(f"  {millions}M rep {rep + 1}: {name} {seconds:.2f} s", file=sys.stderr)
    if checkpointer is not None:
        checkpointer.close()
    width, layers = shape(millions)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\n**{params / 1e6:.1f}M parameters** ({layers} x `nn.Linear({width}, {width})`, "
        f"Adam after one step): checkpoint tensors {nbytes / 2**30:.3f} GiB "
        f"({nbytes:,d} bytes), median of {repeats}\n"
    )
    print("| save | median s | GB/s | vs torch.save + fsync |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times["torch.save"])
    median = {name: statistics.median(ts) for name, ts in times.items() if ts}
    for name in runs:
        s = median[name]
        print(f"| {LABELS[name]} | {s:.3f} | {nbytes / s / 1e9:.2f} | {s / base:.2f}x |")
    if checkpointer is None:
        print("| glassloop async | async: not available | | |")
    else:
        blocking, total = median["blocking"], median["total"]
        share = 100 * blocking / median["glassloop sync"]
        print(
            f"| glassloop async: blocking (`save()`) | {blocking:.3f} | | {blocking / base:.2f}x "
            f"({share:.0f}% of glassloop sync) |"
        )
        print(
            f"| glassloop async: total (`wait()`) | {total:.3f} | {nbytes / total / 1e9:.2f} "
            f"| {total / base:.2f}x |"
        )
    return saved[-1], nbytes


def resume(millions: int, root: Path, repeats: int) -> None:
    """Print the table of a resume from the checkpoint of ``millions`` parameters: fresh
    processes, the hand resume and glassloop's taking turns (page cache warm: just written)."""
    model, optimizer = build(millions)
    run_dir = root / f"{millions}M-resume"
    run_dir.mkdir()
    checkpointer = Checkpointer(run_dir, CheckpointConfig(), model=model, say=lambda _: None)
    checkpointer.attach({"loop": TrainState(step=1), "optimizer": optimizer})
    paths = {"glassloop": checkpointer.save(), "hand": root / f"{millions}M-resume.pt"}
    torch_save(paths["hand"], model, optimizer)
    del model, optimizer, checkpointer  # (their memory back before the fresh processes)
    for file in [paths["hand"], *paths["glassloop"].iterdir()]:  # (into the page cache: a
        file.read_bytes()  # large file is written past it, glassloop.storage.hashed_files)
    width, layers = shape(millions)
    phases: dict[str, list[list[float]]] = {"hand": [], "glassloop": []}
    for rep in range(repeats):
        for how in phases:  # (taking turns: a slower moment of the box slows both)
            command = [sys.executable, "-c", RESUME, how, str(width), str(layers), str(paths[how])]
            start = time.time()  # (wall clock: the child's stamps are compared with it)
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            imported, built, loaded, cpu = json.loads(done.stdout.splitlines()[-1])
            phases[how].append([imported - start, built - imported, loaded - built, cpu])
            phases[how][-1].append(loaded - start)
            print(
                f"  resume {millions}M rep {rep + 1}: {how} {loaded - start:.2f} s", file=sys.stderr
            )
    median = {
        how: [statistics.median(p[i] for p in ps) for i in range(5)] for how, ps in phases.items()
    }
    nbytes = sum(p.stat().st_size for p in paths["glassloop"].iterdir())
    print(
        f"\n**Resume, {millions}M parameters** ({layers} x `nn.Linear({width}, {width})` and Adam; "
        f"glassloop's checkpoint {nbytes / 2**30:.3f} GiB, the `torch.save` file "
        f"{paths['hand'].stat().st_size / 2**30:.3f} GiB), fresh processes taking turns, page "
        f"cache warm, median of {repeats}\n"
    )
    print("| phase | hand: s | glassloop: s | ratio |")
    print("|---|---:|---:|---:|")
    names = (
        "python start + imports",
        "build the model and Adam (default init)",
        "load: the checkpoint into the model and Adam",
        "load: CPU seconds (all threads)",
        "**total: process start to the first step**",
    )
    for i, name in enumerate(names):
        hand, ours = median["hand"][i], median["glassloop"][i]
        print(f"| {name} | {hand:.3f} | {ours:.3f} | {ours / hand:.2f}x |")


class StepClock(Callback):
    """The wall-clock time of each ``on_step_end`` (a callback: the time between two is one
    step, and a save after the first lands in the second's)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, trainer: Any, step: int, loss: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())


STEP_COST = {
    "none": {"every_n_steps": 0},
    "sync": {},
    "async": {"async_save": True},
    "async, writer not niced": {"async_save": True},  # (what lowering its priority gives)
}
WINDOW = 6  # the save's step and the five after it


def step_cost(millions: int, root: Path, repeats: int, every: int, saves: int) -> None:
    """Print the table of what a save costs the training around it: ``Trainer.fit`` of the
    Linear stack (Adam, batch 64, MSE) saving every ``every`` steps, synchronously, in the
    background and not at all, the three taking turns in each round. A save's cost: the
    time the save's step and the five after it take beyond the typical step (the median
    step of the same run away from its saves); the first save of each run (its host
    buffers allocated) is left out."""
    width, layers = shape(millions)
    steps = every * (saves + 1) + WINDOW
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64 * steps, width, generator=g), torch.randn(64 * steps, width, generator=g)
    )
    extra: dict[str, list[float]] = {how: [] for how in STEP_COST if how != "none"}
    typical: list[float] = []
    for rep in range(repeats):
        for how, options in STEP_COST.items():
            model, optimizer = build(millions)
            clock = StepClock()
            run_dir = root / f"step-cost-{rep}-{how}"
            trainer = Trainer(
                model,
                optimizer,
                nn.MSELoss(),
                device="cpu",
                progress="none",
                run_dir=run_dir,
                callbacks=[clock],
                checkpoint=CheckpointConfig(**{"every_n_steps": every, **options}),
            )
            loader = torch.utils.data.DataLoader(data, batch_size=64)
            niced = background.yield_to_training
            if how == "async, writer not niced":
                background.yield_to_training = lambda: None
            try:
                trainer.fit(loader, epochs=1)
            finally:
                background.yield_to_training = niced
            seconds = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
            # seconds[i]: step i + 2 (and the save after step i + 1, if any). The typical
            # step: the run's own median away from its saves (the box's load changes
            # between runs more than within one).
            windows = [range(k * every - 1, k * every - 1 + WINDOW) for k in range(1, saves + 2)]
            away = [t for i, t in enumerate(seconds) if i > 1 and not any(i in w for w in windows)]
            typical.append(statistics.median(away))
            for window in windows[1:] if how != "none" else ():
                extra[how].append(sum(seconds[i] for i in window) - WINDOW * typical[-1])
            print(f"  step cost rep {rep + 1}: {how} {sum(seconds):.2f} s", file=sys.stderr)
            shutil.rmtree(run_dir)
            del trainer, model, optimizer
    params = sum(p.numel() for p in build(millions)[0].parameters())
    print(
        f"\n**What a save costs the steps around it**, {params / 1e6:.1f}M parameters "
        f"({layers} x `nn.Linear({width}, {width})`), Adam, batch 64, `Trainer.fit` saving "
        f"every {every} steps; the typical step {statistics.median(typical):.3f} s (no saves: "
        f"{statistics.median(typical[:: len(STEP_COST)]):.3f} s); median of "
        f"{len(extra['sync'])} saves over {repeats} rounds\n"
    )
    print("| save | extra s: the save's step and the 5 after it | of a sync save |")
    print("|---|---:|---:|")
    sync = statistics.median(extra["sync"])
    for how, values in extra.items():
        cost = statistics.median(values)
        print(f"| {how} | {cost:.3f} | {100 * cost / sync:.0f}% |")


def filesystem(path: Path) -> str:
    """The file system type of ``path``'s mount (Linux), or "?"."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    target = str(path.resolve())
    best = max(
        (m for m in mounts if len(m) > 2 and (target + "/").startswith(m[1].rstrip("/") + "/")),
        key=lambda m: len(m[1]),
        default=None,
    )
    return f"{best[2]} on {best[0]}" if best else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="50,200", help="model sizes in millions of parameters, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved saves per row")
    parser.add_argument(
        "--dir", type=Path, default=Path("."), help="a folder on the disk to measure"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="time a resume at each size instead: glassloop's against torch.load + load_state_dict",
    )
    parser.add_argument(
        "--step-cost",
        action="store_true",
        help="time what a save costs the training steps around it instead (sync, async, none)",
    )
    parser.add_argument("--every", type=int, default=10, help="--step-cost: steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="--step-cost: saves per run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (DCP's: no_dist)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    root = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=args.dir))
    (root / ".gitignore").write_text("*\n")  # never swept into a commit while it runs
    try:
        print(
            f"machine: {os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, "
            f"Python {platform.python_version()}, OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; --dir {args.dir} "
            f"({filesystem(root)})"
        )
        for millions in sizes:
            if args.step_cost:
                step_cost(millions, root, args.repeats, args.every, args.saves)
            elif args.resume:
                resume(millions, root, args.repeats)
            else:
                measure(millions, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
