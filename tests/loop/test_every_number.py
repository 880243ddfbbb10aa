"""Every number glassloop reports is right, not only the weights: for each task
(classification, its running train_accuracy too; BCELoss on probabilities; multilabel; regression far from zero; a language
model with its own shifted loss; a loss that sums over its batch, accumulated) x {1 process,
2 processes under torchrun, 2 Ray Train workers, 2 torchrun nodes of one process} x
{uninterrupted; killed with SIGKILL mid-epoch or at an epoch boundary and
resumed in a new process} x {glassloop's loader, a shuffling DataLoader, a DataLoader with its
own generator, Parquet shards in a bucket of a real S3 server read by glassloop (classification)} x {checkpoints written as the step waits, in the background (async_save: a kill
may come while one is in flight)}, every epoch row, every step row, "best", ``evaluate`` and ``predict`` equal an
independent computation in plain PyTorch and scikit-learn written here, and the final weights
equal the hand-written loop's (bitwise in one process).

Under Ray the killed worker is restarted by Ray and resumes from Ray's checkpoint in the same
job; on two nodes (c10d rendezvous on 127.0.0.1, one run directory: a shared filesystem) both
are started again with ``--resume``. Ray and two nodes run with glassloop's loader (the one
that shards), in the full matrix for two tasks (they change how processes start and resume,
not what a task computes).

By default a diagonal of the matrix runs (every value of every axis at least once, ~2 min);
the whole matrix (~25 min): ``GLASSLOOP_MATRIX=full .venv/bin/pytest tests/loop/test_every_number.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import pytest
import torch
from cli_runner import free_port
from matrix_runs import (
    BATCH,
    EPOCHS,
    LOADERS,
    TASKS,
    accumulation,
    data,
    loaders,
    model_and_loss,
    write_shards,
)
from s3_server import local_s3
from safetensors.torch import load_file
from sklearn import metrics as skm

from glassloop.step.throughput import TIMING
from glassloop.tracking.runs import read_rows, summarise

SCRIPT = Path(__file__).with_name("matrix_runs.py")
# 88 training samples in global batches of 16: 6 steps per epoch (3 with 2 micro-batches).
KILLS = {"none": None, "mid-epoch": (4, 5), "epoch-boundary": (7, 4)}  # (accum 1, accum 2)
SAVES = ("sync", "async")
# How the processes start: one; two under torchrun; two Ray Train workers; two torchrun nodes.
LAUNCHERS: tuple[int | str, ...] = (1, 2, "ray", "nodes")
DIAGONAL: list[tuple[str, str, str, int | str, str]] = [
    ("classification", "glassloop", "mid-epoch", 2, "async"),  # (a mid-epoch DDP resume)
    ("lm", "glassloop", "mid-epoch", "ray", "async"),
    ("multilabel", "glassloop", "epoch-boundary", "nodes", "sync"),
    ("bce", "dataloader", "none", 1, "sync"),
    ("multilabel", "glassloop", "epoch-boundary", 1, "async"),
    ("regression", "generator", "mid-epoch", 1, "async"),
    ("lm", "glassloop", "mid-epoch", 1, "sync"),
    ("sum", "generator", "epoch-boundary", 1, "sync"),
    ("classification", "shards", "mid-epoch", 2, "sync"),  # (Parquet in a bucket, DDP)
]
FULL = [
    (task, kind, kill, procs, save)
    for task, kill, save in itertools.product(TASKS, KILLS, SAVES)
    for kind, procs in [*((k, 1) for k in LOADERS), ("glassloop", 2), ("shards", 2)]
    if kind != "shards" or task == "classification"  # (shards hold class labels)
] + [
    (task, "glassloop", kill, procs, save)
    for task, kill, save, procs in itertools.product(
        ("classification", "lm"), KILLS, SAVES, ("ray", "nodes")
    )
]
CASES = FULL if os.environ.get("GLASSLOOP_MATRIX") == "full" else DIAGONAL


def run_script(run: Path, task: str, kind: str, procs: int | str, *extra: str) -> int:
    """One glassloop run in a new process (torchrun for two, its workers new interpreters;
    the driver of a Ray Train job; forked: tests/forkserver.py), or two torchrun nodes; its
    exit code."""
    args = [str(SCRIPT), task, kind, str(run), *extra, *(["--ray"] if procs == "ray" else [])]
    if procs == "nodes":
        return two_nodes(args, killing="--kill-at" in extra)
    if procs == 2:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *args]
    done = forkserver.run([sys.executable, *args], timeout=300)
    if done.returncode not in (0, -9) and "--kill-at" not in extra:
        raise AssertionError(done.stderr[-3000:])
    return done.returncode


def two_nodes(args: list[str], *, killing: bool) -> int:
    """``args`` on two torchrun nodes of one process each (c10d rendezvous on 127.0.0.1),
    started together; the first non-zero exit code of the two, or 0."""
    port = free_port()
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
        f"matrix-{port}", "--max-restarts", "0", *args,
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    codes, said = [], []
    for node in nodes:
        try:
            out, _ = node.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            out, _ = node.communicate()
        codes.append(node.returncode)
        said.append(out)
    if any(codes) and not killing:
        raise AssertionError("\n".join(text[-2000:] for text in said))
    return next((code for code in codes if code), 0)


# ------------------------------------------------------------------ the independent reference
def hand_run(task: str, kind: str) -> dict[str, Any]:
    """The same training as a plain loop, and every number computed from its tensors."""
    model, loss_fn = model_and_loss(task)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train, val = loaders(task, kind)
    accum = accumulation(task)
    history: list[dict[str, Any]] = []
    step_losses: list[float] = []
    steps = samples = 0
    for epoch in range(1, EPOCHS + 1):
        model.train()
        total = 0.0
        seen = correct = 0  # (correct: train_accuracy's, a classifier's)
        batches = list(train)
        for start in range(0, len(batches), accum):
            window = batches[start : start + accum]
            window_total = 0.0
            for x, y in window:
                out = None if loss_fn is None else model(x)
                loss = own_loss(model, x, y) if loss_fn is None else loss_fn(out, y)
                loss.backward()
                if task == "classification":  # the labels this forward got right
                    correct += int((out.argmax(-1) == y).sum())
                per = float(loss.detach()) * (1 if task == "sum" else len(x))
                window_total += per
            optimizer.step()
            optimizer.zero_grad()
            n = sum(len(x) for x, _ in window)
            steps, samples, seen, total = steps + 1, samples + n, seen + n, total + window_total
            step_losses.append(window_total / n)
        row = {"epoch": epoch, "step": steps, "samples": samples, "train_loss": total / seen}
        if task == "classification":
            row["train_accuracy"] = correct / seen
        row.update({f"val_{k}": v for k, v in hand_evaluate(task, model, loss_fn, val).items()})
        row["lr"] = 1e-2
        history.append(row)
    model.eval()
    with torch.no_grad():
        output = model(data(task)[2])
    logits = output["logits"] if isinstance(output, dict) else output
    predicted = {
        "classification": lambda o: torch.softmax(o, -1), "bce": lambda o: o,
        "multilabel": torch.sigmoid, "regression": lambda o: o, "lm": lambda o: torch.softmax(o, -1),
        "sum": lambda o: o,
    }[task](logits)  # fmt: skip
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return {"history": history, "steps": step_losses, "predict": predicted, "weights": weights}


def own_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x, labels=y)["loss"]
    return out


def hand_evaluate(task: str, model: Any, loss_fn: Any, val: Any) -> dict[str, float]:
    model.eval()
    losses, outputs, targets = [], [], []
    with torch.no_grad():
        for x, y in val:
            if task == "lm":
                out = model(x, labels=y)
                tokens = int((y[:, 1:] != -100).sum())
                losses.append((float(out["loss"]) * tokens, tokens))
                outputs.append(out["logits"][:, :-1].reshape(-1, out["logits"].shape[-1]))
                targets.append(y[:, 1:].reshape(-1))
            else:
                out = model(x)
                loss = float(loss_fn(out, y))
                losses.append((loss, 1) if task == "sum" else (loss * len(x), len(x)))
                outputs.append(out)
                targets.append(y)
    model.train()
    n = sum(len(t) for t in targets) if task != "lm" else sum(c for _, c in losses)
    result = {
        "loss": sum(v for v, _ in losses) / (n if task != "lm" else sum(c for _, c in losses))
    }
    out, y = torch.cat(outputs).double().numpy(), torch.cat(targets).numpy()
    if task == "lm":
        kept = y != -100
        result["accuracy"] = float((out.argmax(-1)[kept] == y[kept]).mean())
        result["perplexity"] = math.exp(result["loss"])
    elif task == "classification":
        result["accuracy"] = skm.accuracy_score(y, out.argmax(-1))
    elif task in ("bce", "multilabel"):
        decided = (out > (0.5 if task == "bce" else 0.0)).astype(int)
        truth = y.astype(int)
        result["accuracy"] = 1 - skm.hamming_loss(truth, decided)
        result["exact_match"] = skm.accuracy_score(truth, decided)
        if task == "bce":  # one label: its F1 (sklearn reads an (N, 1) column as binary,
            # where "micro" would average over both classes, i.e. give the accuracy)
            f1 = skm.f1_score(truth.ravel(), decided.ravel(), average="binary", zero_division=0)
            result["f1_micro"] = result["f1_macro"] = f1
        else:
            result["f1_micro"] = skm.f1_score(truth, decided, average="micro", zero_division=0)
            result["f1_macro"] = skm.f1_score(truth, decided, average="macro", zero_division=0)
    elif task == "regression":
        result["mae"] = skm.mean_absolute_error(y, out)
        result["rmse"] = skm.root_mean_squared_error(y, out)
        result["r2"] = skm.r2_score(y, out)
    return result


_HAND: dict[tuple[str, str], dict[str, Any]] = {}


def reference(task: str, kind: str) -> dict[str, Any]:
    if (task, kind) not in _HAND:
        _HAND[task, kind] = hand_run(task, kind)
    return _HAND[task, kind]


# ---------------------------------------------------------------------------------- the test
def close(a: Any, b: Any, rel: float) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-9)
    return bool(a == b)


@pytest.mark.parametrize(("task", "kind", "kill", "procs", "save"), CASES)
def test_every_reported_number(
    tmp_path: Path, task: str, kind: str, kill: str, procs: int | str, save: str
) -> None:
    with local_s3("matrix") if kind == "shards" else contextlib.nullcontext():
        if kind == "shards":
            write_shards(task)
            _HAND.pop((task, kind), None)  # (the bucket is this test's)
        check_every_number(tmp_path, task, kind, kill, procs, save)


def check_every_number(
    tmp_path: Path, task: str, kind: str, kill: str, procs: int | str, save: str
) -> None:
    run = tmp_path / "run"
    at = KILLS[kill]
    saves = ("--async-save",) if save == "async" else ()
    if at is not None and procs == "ray":  # Ray restarts the killed worker in the same job
        step = at[0] if accumulation(task) == 1 else at[1]
        assert run_script(run, task, kind, procs, "--kill-at", str(step), *saves) == 0
        assert (tmp_path / "run.killed").exists(), "the run was not killed"
    elif at is not None:
        step = at[0] if accumulation(task) == 1 else at[1]
        code = run_script(run, task, kind, procs, "--kill-at", str(step), *saves)
        assert code != 0, "the run was not killed"
        assert not (run / "numbers.json").exists()
        run_script(run, task, kind, procs, "--resume", *saves)
    else:
        run_script(run, task, kind, procs, *saves)
    hand = reference(task, kind)
    rel = 1e-9 if procs == 1 else 2e-5  # (two processes add in another order)
    numbers = json.loads((run / "numbers.json").read_text())
    # Every epoch row: the same keys, every value equal to the hand computation.
    for ours, theirs in zip(numbers["history"], hand["history"], strict=True):
        shown = {k: v for k, v in ours.items() if k not in ("kind", *TIMING)}
        assert shown.keys() == theirs.keys(), (sorted(shown), sorted(theirs))
        for key, value in theirs.items():
            # (a step's loss is a float32 sum over micro-batches: float32's precision)
            tolerance = max(rel, 1e-6) if key == "train_loss" else rel
            assert close(shown[key], value, tolerance), (key, shown[key], value)
    # metrics.jsonl: each epoch once, each step once, each step's loss the hand loop's.
    epochs = read_rows(run, "epoch")
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1))
    step_rows = read_rows(run, "step")
    assert [r["step"] for r in step_rows] == list(range(1, len(hand["steps"]) + 1))
    for row, loss in zip(step_rows, hand["steps"], strict=True):
        assert close(row["loss"], loss, max(rel, 1e-6)), (
            row["step"],
            row["loss"],
            loss,
        )  # (float32)
    # Each epoch's every step loss (the report's per-step plot): once, equal to the step rows.
    every = read_rows(run, "losses")
    assert [r["epoch"] for r in every] == list(range(1, EPOCHS + 1))
    plotted = [(r["first_step"] + i, loss) for r in every for i, loss in enumerate(r["loss"])]
    assert plotted == [(row["step"], row["loss"]) for row in step_rows]
    # evaluate() after training is the last epoch's validation; predict() the hand model's.
    last = hand["history"][-1]
    for key, value in numbers["evaluate"].items():
        assert close(value, last[f"val_{key}"], rel), key
    assert torch.allclose(torch.tensor(numbers["predict"]), hand["predict"].float(), atol=1e-6)
    # "best": the epoch with the best val_loss, named, as glassloop runs prints it.
    losses = [row["val_loss"] for row in hand["history"]]
    summary = summarise(run)
    assert summary is not None and summary.best.startswith("val_loss ")
    assert summary.best.endswith(f"(epoch {int(np.argmin(losses)) + 1})")
    # The final weights: bitwise the hand loop's in one process.
    weights = load_file(run / "model.safetensors")
    for key, value in hand["weights"].items():
        if procs == 1:
            assert torch.equal(weights[key], value), key
        else:
            assert torch.allclose(weights[key], value, rtol=1e-4, atol=1e-6), key


def test_the_diagonal_covers_every_value_of_every_axis() -> None:
    for axis, values in enumerate((TASKS, LOADERS, tuple(KILLS), LAUNCHERS, SAVES)):
        assert {case[axis] for case in DIAGONAL} == set(values), axis
    assert BATCH % 2 == 0  # two processes split the global batch evenly
