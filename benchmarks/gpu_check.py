"""The GPU check: one script, one table, a few minutes on one GPU.

    .venv/bin/python benchmarks/gpu_check.py                  # on CUDA (the default device)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick   # the CI smoke test

Rows (each a measurement and a verdict):

* overhead of ``Trainer.fit`` against the hand-written loop, tutorial MLP and a small CNN, fp32
  and bf16, and a small GPT (33M parameters, bf16, ``torch.compile`` off and on), the two
  loops interleaved in one process (as benchmarks/overhead.py does), with the device
  synchronised before each clock read;
* the GPT's tokens/s and MFU (model FLOPs utilisation: FLOPs of a step counted by
  ``torch.utils.flop_counter``, the peak bf16 dense FLOP/s looked up from the device's name);
* host syncs per step of a default ``fit`` and of the hand loop (CUDA:
  ``torch.cuda.set_sync_debug_mode("warn")``'s warnings counted; CPU: reads of a tensor's
  value, ``Tensor.item``/``__bool__``/``__float__``/``__int__``/``tolist``/``numpy``/``cpu``);
* bf16 speed-up over fp32 (hand loop);
* fp16 + GradScaler: steps skipped after warm-up (should be 0) and the final loss against fp32;
* peak memory of a fit; the GPT's with activation checkpointing off and on;
* ``torch.compile`` on/off, per step after the compile;
* glassloop's in-memory loader with the data on the device against a pinned ``DataLoader``;
* kill -9 in the middle of a run and resume: bitwise equal final weights, with
  ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from glassloop import Trainer
from glassloop.config.models import cnn, mlp
from glassloop.data import make_loader
from glassloop.precision import autocast

Batches = list[tuple[torch.Tensor, torch.Tensor]]
ROWS: list[tuple[str, str, str]] = []


def row(check: str, value: str, verdict: str = "") -> None:
    ROWS.append((check, value, verdict))
    print(f"  {check}: {value} {verdict}", file=sys.stderr, flush=True)  # progress


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def data(n: int, batch: int, device: torch.device, seed: int = 0) -> Batches:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [
        (a.to(device), b.to(device)) for a, b in zip(x.split(batch), y.split(batch), strict=True)
    ]


def hand_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any,
               precision: str, device: torch.device, loss_fn: Any = None) -> None:  # fmt: skip
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    model.train()
    for x, y in batches:
        with autocast(precision, device):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def glassloop_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any,
                    precision: str, device: torch.device, loss_fn: Any = None,
                    task: str = "auto") -> None:  # fmt: skip
    trainer = Trainer(model, optimizer, loss_fn or nn.CrossEntropyLoss(), device=device,
                      progress="none", precision=precision, task=task)  # fmt: skip
    trainer.fit(batches, epochs=1)


class SmallGPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm transformer blocks under
    a causal mask (torch's own layers: scaled-dot-product attention), a linear head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        mask = nn.Transformer.generate_square_subsequent_mask(context)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        h = self.tokens(idx) + self.positions.weight[:length]
        h = self.blocks(h, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(h))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the targets are the inputs shifted by one)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def gpt_data(steps: int, batch: int, context: int, vocab: int, device: torch.device) -> Batches:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab, (steps * batch, context + 1), generator=g)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in text.split(batch)]


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def overhead(name: str, build: Callable[[], nn.Module], precision: str, batches: Batches,
             device: torch.device, reps: int, loss_fn: Any = None, task: str = "auto",
             compiled: bool = False) -> tuple[float, float]:  # fmt: skip
    """Median ratio glassloop/hand over interleaved reps; returns the hand loop's s/step and
    the ratio.
    ``compiled``: both loops train a ``torch.compile``d model (glassloop's ``compile=True``
    compiles its own copy the same way)."""
    torch.manual_seed(0)
    a, b = build().to(device), build().to(device)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-3)
    hand_model = torch.compile(a) if compiled else a
    trainer = Trainer(b, opt_b, loss_fn or nn.CrossEntropyLoss(), device=device,
                      progress="none", precision=precision, task=task,
                      compile=compiled)  # fmt: skip

    def hand() -> None:
        hand_epoch(cast(nn.Module, hand_model), opt_a, batches, precision, device, loss_fn)

    def ours() -> None:
        trainer.fit(batches, epochs=trainer.state.epoch + 1)  # one more epoch

    hand(), ours()  # warm-up: kernels, allocator, compilation
    ratios, hands = [], []
    for rep in range(reps):
        order = [hand, ours] if rep % 2 == 0 else [ours, hand]
        first, second = (timed(fn, device) for fn in order)
        t_hand, t_glass = (first, second) if rep % 2 == 0 else (second, first)
        ratios.append(t_glass / t_hand)
        hands.append(t_hand / len(batches))
    ratio = statistics.median(ratios)
    hand_us = 1e6 * statistics.median(hands)
    verdict = "ok" if ratio <= 1.05 else "above 5%"
    label = f"overhead {name} {precision}{' compiled' if compiled else ''}"
    row(label, f"{ratio:.3f} (hand {hand_us:.0f} us/step)", verdict)
    return statistics.median(hands), ratio


# Peak dense bf16 tensor FLOP/s by device name (vendors' data sheets; SXM parts).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
             "A10": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12}  # fmt: skip


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def gpt_check(device: torch.device, quick: bool, reps: int) -> None:
    """The small GPT: overhead in bf16 with compile off and on, tokens/s and MFU."""
    vocab, width, layers, heads, context, batch, steps = (
        (128, 64, 2, 2, 32, 4, 2) if quick else (8192, 512, 8, 8, 256, 32, 40)
    )
    build = lambda: SmallGPT(vocab, width, layers, heads, context)  # noqa: E731
    batches = gpt_data(steps, batch, context, vocab, device)
    params = sum(p.numel() for p in build().parameters())
    label = f"small GPT ({params / 1e6:.1f}M)"
    compile_runs = (False,) if quick and device.type == "cpu" else (False, True)
    per_step, ratio = 0.0, 1.0
    for compiled in compile_runs:
        per_step, ratio = overhead(label, build, "bf16", batches, device, reps, lm_loss,
                            "language-model", compiled)  # fmt: skip
    if len(compile_runs) == 1:
        row(f"overhead {label} bf16 compiled", "skipped (--quick on CPU)")
    model = build().to(device)
    with FlopCounterMode(display=False) as counter:  # one step's forward and backward
        with autocast("bf16", device):
            loss = lm_loss(model(batches[0][0]), batches[0][1])
        loss.backward()
    flops = counter.get_total_flops()
    tokens = batch * context
    peak = peak_flops(device)
    how = "compiled" if compile_runs[-1] else "eager"
    for loop, seconds in (("hand loop", per_step), ("glassloop", per_step * ratio)):
        mfu = f", MFU {flops / seconds / peak:.1%} of {peak / 1e12:.0f}" if peak else ""
        speed = f"{tokens / seconds:,.0f} tokens/s, {flops / seconds / 1e12:.2f} TFLOP/s"
        row(f"{label} bf16 {how}, {loop}", speed + mfu)


READS = ("item", "__bool__", "__float__", "__int__", "tolist", "numpy", "cpu")


@contextmanager
def host_syncs(device: torch.device) -> Iterator[list[int]]:
    """Counts host syncs inside the block into the yielded list's one element: CUDA's sync
    debug mode warns at each synchronising call; on a CPU every read of a tensor's value."""
    count = [0]
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield count
            finally:
                torch.cuda.set_sync_debug_mode(0)
        count[0] = sum("synchroniz" in str(w.message) for w in caught)
        return
    real = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return real[name](self, *args, **kwargs)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        yield count
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)


def sync_check(device: torch.device, quick: bool) -> None:
    """Host syncs of one epoch: the hand loop and a default ``fit`` (step rows off)."""
    batches = data(64 * 16 if quick else 200 * 64, 16 if quick else 64, device, seed=1)
    counts = {}
    for loop in ("hand", "glassloop"):
        torch.manual_seed(0)
        model = mlp((1, 28, 28), 10, [512, 512]).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        if loop == "glassloop":  # (built outside the count: its set-up is not a step)
            trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), device=device,
                              progress="none", log_every=10**6)  # fmt: skip
        with host_syncs(device) as count:
            if loop == "hand":
                hand_epoch(model, optimizer, batches, "32", device)
            else:
                trainer.fit(batches, epochs=1)
        counts[loop] = count[0]
    steps = len(batches)
    value = (f"{counts['glassloop'] / steps:.2f} per step ({counts['glassloop']} in a "
             f"{steps}-step fit; hand loop {counts['hand']})")  # fmt: skip
    # A default fit reads a few values per epoch (its end), none per step.
    ok = counts["glassloop"] - counts["hand"] <= 30
    row("host syncs, default fit (MLP, one epoch)", value, "ok" if ok else "per step")


def fp16_check(batches: Batches, device: torch.device) -> None:
    """fp16 + GradScaler from the same start as fp32: no skipped step after warm-up and a
    final loss close to fp32's."""
    losses, skipped = {}, {}
    for precision in ("32", "fp16"):
        torch.manual_seed(0)
        model = mlp((1, 28, 28), 10, [512, 512]).to(device)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          nn.CrossEntropyLoss(), device=device, progress="none",
                          precision=precision)  # fmt: skip
        trainer.fit(batches[:20], epochs=1)  # warm-up: the scaler finds its scale
        warm = trainer.state.skipped_steps
        history = trainer.fit(batches, epochs=4)
        losses[precision] = history[-1]["train_loss"]
        skipped[precision] = trainer.state.skipped_steps - warm
    close = abs(losses["fp16"] - losses["32"]) <= 0.05 * abs(losses["32"]) + 0.02
    value = (
        f"skipped after warm-up {skipped['fp16']}, loss {losses['fp16']:.4f} "
        f"vs fp32 {losses['32']:.4f}"
    )
    row("fp16 + GradScaler", value, "ok" if close and not skipped["fp16"] else "CHECK")


def memory_check(batches: Batches, device: torch.device) -> None:
    if device.type != "cuda":
        row("peak memory", "n/a on CPU")
        return
    torch.cuda.reset_peak_memory_stats(device)
    model = mlp((1, 28, 28), 10, [512, 512]).to(device)
    glassloop_epoch(model, torch.optim.AdamW(model.parameters()), batches, "bf16", device)
    row(
        "peak memory (MLP, bf16, one fit)",
        f"{torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB",
    )


def checkpointing_check(device: torch.device, quick: bool) -> None:
    """The small GPT's peak memory in one bf16 fit with its blocks' activations kept and
    recomputed (``activation_checkpointing``), and whether the weights end equal."""
    if device.type != "cuda":
        row("activation checkpointing (GPT blocks)", "n/a on CPU (the unit test counts the "
            "saved activations instead)")  # fmt: skip
        return
    vocab, width, layers, heads, context, batch, steps = (
        (128, 64, 2, 2, 32, 4, 2) if quick else (8192, 512, 8, 8, 256, 32, 10)
    )
    batches = gpt_data(steps, batch, context, vocab, device)
    peaks, weights = [], []
    for names in ([], ["TransformerEncoderLayer"]):
        torch.manual_seed(0)
        model = SmallGPT(vocab, width, layers, heads, context).to(device)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-4), lm_loss,
                          device=device, progress="none", precision="bf16",
                          task="language-model", activation_checkpointing=names)  # fmt: skip
        torch.cuda.reset_peak_memory_stats(device)
        trainer.fit(batches, epochs=1)
        peaks.append(torch.cuda.max_memory_allocated(device) / 2**20)
        weights.append(model.state_dict())
    same = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    value = f"{peaks[0]:.0f} MiB kept, {peaks[1]:.0f} MiB recomputed; weights equal: {same}"
    row("activation checkpointing (GPT blocks), peak memory", value)


def compile_check(batches: Batches, device: torch.device, quick: bool) -> None:
    if quick and device.type == "cpu":
        row("torch.compile", "skipped (--quick on CPU: inductor's C++ build takes minutes)")
        return
    times = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = mlp((1, 28, 28), 10, [512, 512]).to(device)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                          nn.CrossEntropyLoss(), device=device, progress="none",
                          compile=compiled)  # fmt: skip
        trainer.fit(batches, epochs=1)  # compiles (and warms up) here
        times[compiled] = timed(lambda t=trainer: t.fit(batches, epochs=3), device) / len(batches)
    value = f"{1e6 * times[True]:.0f} us vs {1e6 * times[False]:.0f} us eager"
    row("torch.compile per step", value, f"x{times[False] / times[True]:.2f}")


def loader_check(n: int, batch: int, device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    fast = make_loader((x, y), batch_size=batch, shuffle=True, device=device)
    pinned = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True,
                        pin_memory=device.type == "cuda")  # fmt: skip

    def drain(loader: Any) -> None:
        for a, b in loader:
            a.to(device, non_blocking=True), b.to(device, non_blocking=True)

    drain(fast), drain(pinned)
    t_fast = min(timed(lambda: drain(fast), device) for _ in range(3))
    t_pinned = min(timed(lambda: drain(pinned), device) for _ in range(3))
    row("in-memory loader on the device vs pinned DataLoader",
        f"{len(fast) / t_fast:,.0f} vs {len(pinned) / t_pinned:,.0f} batches/s",
        f"x{t_pinned / t_fast:.1f}")  # fmt: skip


class KillAt:
    """Cross-entropy that SIGKILLs its own process at call ``at`` (mid-run, mid-epoch)."""

    def __init__(self, at: int) -> None:
        self.calls, self.at = 0, at

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return nn.functional.cross_entropy(output, target)


def resume_run(run_dir: str, device: str, kill_at: int, resume: bool, quick: bool) -> None:
    """One training run for the kill check (also what the killed child process runs)."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    dev = torch.device(device)
    model = cnn((1, 28, 28), 10).to(dev)
    g = torch.Generator().manual_seed(1)
    n = 512 if quick else 4096
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), KillAt(kill_at),
                      device=dev, progress="none", run_dir=run_dir,
                      checkpoint=None)  # fmt: skip
    trainer.checkpointer.policy.every_n_steps = 3
    loader = make_loader((x, y), batch_size=64, shuffle=True, seed=0, device=dev)
    trainer.fit(loader, epochs=2, resume="auto" if resume else None)


def kill_resume_check(device: torch.device, quick: bool) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    with tempfile.TemporaryDirectory() as tmp:
        straight, cut = f"{tmp}/straight", f"{tmp}/cut"
        resume_run(straight, str(device), 0, False, quick)
        args = [sys.executable, __file__, "--child", cut, "--device", str(device)]
        child = subprocess.run([*args, *(["--quick"] if quick else [])], check=False,
                               env={**os.environ}, capture_output=True, text=True)  # fmt: skip
        killed = child.returncode == -signal.SIGKILL
        resume_run(cut, str(device), 0, True, quick)
        from glassloop import load_weights

        a, b = cnn((1, 28, 28), 10), cnn((1, 28, 28), 10)
        load_weights(a, Path(straight) / "model.safetensors")
        load_weights(b, Path(cut) / "model.safetensors")
        pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        same = all(torch.equal(p, q) for p, q in pairs)
    row("kill -9 mid-run + resume (deterministic)",
        f"killed: {killed}, final weights bitwise equal: {same}",
        "ok" if killed and same else "FAIL")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--child", metavar="RUN_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # the process the kill check kills
        resume_run(args.child, args.device, 11, False, args.quick)
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; pass --device cpu for the smoke test")
    # (--quick on a CPU: a bf16 CNN step takes ~0.7 s here; the smoke test needs 2 batches)
    n, reps = (128, 2) if args.quick else (12_800, 11)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    start = time.perf_counter()
    batches = data(n, 64, device)
    mlp_build = lambda: mlp((1, 28, 28), 10, [512, 512])  # noqa: E731
    cnn_build = lambda: cnn((1, 28, 28), 10)  # noqa: E731
    per_step = {}
    for precision in ("32", "bf16"):
        mlp_step, _ = overhead("tutorial MLP", mlp_build, precision, batches, device, reps)
        per_step[precision] = mlp_step
        overhead("small CNN", cnn_build, precision, batches, device, reps)
    row("bf16 speed-up over fp32 (hand loop, MLP)", f"x{per_step['32'] / per_step['bf16']:.2f}")
    gpt_check(device, args.quick, reps)
    sync_check(device, args.quick)
    fp16_check(batches, device)
    memory_check(batches, device)
    checkpointing_check(device, args.quick)
    compile_check(batches, device, args.quick)
    loader_check(n * 4, 256, device)
    kill_resume_check(device, args.quick)
    width = max(len(r[0]) for r in ROWS)
    print(f"glassloop GPU check on {name}, torch {torch.__version__}, "
          f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    print(f"| {'check':<{width}} | result | verdict |\n|{'-' * (width + 2)}|---|---|")
    for check, value, verdict in ROWS:
        print(f"| {check:<{width}} | {value} | {verdict} |")


if __name__ == "__main__":
    main()
