"""``Trainer(profile=N)`` / ``glassloop train --profile N``: a ``torch.profiler`` trace of N
optimizer steps (after one step of warm-up) written to ``RUN_DIR/profile/trace.json``
(open it in Perfetto or ``chrome://tracing``), and the ten operators that took the most
time printed when the steps are done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from glassloop.distributed.world import World
from glassloop.run_dir import layout
from glassloop.storage.atomic import atomic_path, own_dir


class StepProfiler:
    """Profiles ``steps`` optimizer steps of a fit: call :meth:`step` after each; the trace
    goes to ``run_dir/profile/`` (none without a run directory) and ``say`` gets the top
    operators, once."""

    def __init__(self, steps: int, run_dir: Path | None, say: Any) -> None:
        self.steps, self.run_dir, self.say = steps, run_dir, say
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=False,
        )
        self._done = False

    def __enter__(self) -> StepProfiler:
        self._profile.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)  # type: ignore[no-untyped-call]

    def step(self) -> None:
        if not self._done:
            self._profile.step()

    def _ready(self, prof: Any) -> None:
        self._done = True
        where = ""
        if self.run_dir is not None:
            folder = own_dir(self.run_dir / layout.PROFILE)  # (a link there: refused)
            with atomic_path(folder / "trace.json") as written:  # (never through a link)
                prof.export_chrome_trace(str(written))
            where = f" (trace: {folder / 'trace.json'})"
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=10)
        self.say(f"profile of {self.steps} steps{where}:\n{table}")


def fit_profiler(steps: int, world: World, run_dir: Path | None, say: Any) -> StepProfiler | None:
    """The profiler of a fit's first ``steps`` steps (``Trainer(profile=N)``), in the main
    process only; ``None`` when not asked for."""
    return StepProfiler(steps, run_dir, say) if steps and world.is_main else None
