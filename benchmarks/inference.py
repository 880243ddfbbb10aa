"""Inference: the ONNX file ``glassloop export --format onnx`` writes, run by onnxruntime,
against the same model eager and under ``torch.compile``, at batch 1 (latency) and 64
(throughput), one thread each (``OMP_NUM_THREADS=1``, ``intra_op_num_threads=1``). Every
model computes what ``glassloop.predict`` returns (the task's softmax inside); the three are
timed interleaved, round by round, and the median of the rounds is printed with its spread.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/inference.py [--rounds 7] [--calls 200]

Models: the demo's MLP (784-256-128-10) and the recipes' CNN (28x28x1), the same weights in
all three; the noise floor is the eager model against itself (two columns, same code).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from torch import nn

from glassloop.config.models import build_model
from glassloop.config.sections import ModelConfig
from glassloop.evaluation.evaluate import activated
from glassloop.serving.exported import export_onnx, quiet

torch.set_num_threads(1)


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    mlp = build_model(ModelConfig(name="mlp", hidden=[256, 128]), (1, 28, 28), 10)
    cnn = build_model(ModelConfig(name="cnn"), (1, 28, 28), 10)
    return {"mlp": mlp.eval(), "cnn": cnn.eval()}


def timed(run: Callable[[], object], calls: int) -> float:
    """Seconds per call over ``calls`` calls (after one warm-up call)."""
    run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200, help="calls per round at batch 1")
    args = parser.parse_args()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")  # fmt: skip
    print(f"{'model':<6}{'batch':>6}  {'runner':<16}{'ms/call':>9}{'spread':>9}"
          f"{'samples/s':>11}{'/ eager':>9}")  # fmt: skip
    folder = Path(tempfile.mkdtemp())
    for name, model in models().items():
        with torch.no_grad():
            compiled = torch.compile(model)
        path = folder / f"{name}.onnx"
        export_onnx(model, path, torch.randn(8, 1, 28, 28))
        session = onnxruntime.InferenceSession(str(path), options, ["CPUExecutionProvider"])
        for batch in (1, 64):
            x = torch.randn(batch, 1, 28, 28)
            feed = {"input": x.numpy()}
            runners: dict[str, Callable[[], object]] = {}

            def eager(m: nn.Module = model, x: torch.Tensor = x) -> object:
                with torch.inference_mode():
                    return activated(m(x), task="classification")

            def compiled_run(m: nn.Module = compiled, x: torch.Tensor = x) -> object:
                with torch.inference_mode():
                    return activated(m(x), task="classification")

            runners = {
                "eager": eager,
                "eager (again)": eager,  # (the noise floor)
                "torch.compile": compiled_run,
                "onnxruntime": lambda s=session, f=feed: s.run(None, f),
            }
            with quiet():
                compiled_run()  # (compiled before the clock starts)
            calls = args.calls if batch == 1 else max(args.calls // 8, 10)
            times: dict[str, list[float]] = {runner: [] for runner in runners}
            for _ in range(args.rounds):  # interleaved: drift hits every runner
                for runner, run in runners.items():
                    times[runner].append(timed(run, calls))
            base = statistics.median(times["eager"])
            for runner, values in times.items():
                median = statistics.median(values)
                spread = (max(values) - min(values)) / median
                print(f"{name:<6}{batch:>6}  {runner:<16}{1000 * median:>9.3f}{spread:>8.0%}"
                      f"{batch / median:>11,.0f}{median / base:>9.2f}")  # fmt: skip
    check = np.allclose(
        session.run(None, {"input": np.ones((2, 1, 28, 28), np.float32)})[0],
        activated(model(torch.ones(2, 1, 28, 28)), task="classification").detach().numpy(),
        atol=1e-5,
    )
    print(f"the ONNX file's outputs equal the model's: {check}")


if __name__ == "__main__":
    main()
