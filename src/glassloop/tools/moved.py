"""An old module path names its new home: where the modules of glassloop's first, flat layout
went when it became part folders (2026-12), for an import of the old path (the docs showed
``from glassloop.checkpointer import CheckpointConfig`` until 2 December) to say so in its one
line instead of a bare ``ModuleNotFoundError``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

# Where the modules of the first, flat layout went when it became part folders (2026-12),
# "old:new" under glassloop. (Old paths that are packages now, such as glassloop.config,
# import as those.)
MOVED_TEXT = """
checkpointer:checkpoint.checkpointer background_save:checkpoint.background
assemble:config.assemble models:config.models losses:config.losses
optimizers:config.optimizers schedules:config.schedules model_options:config.sections
loss_options:config.sections optim_options:config.sections fsdp:distributed.fsdp
preemption:distributed.preemption metrics:evaluation.metrics
metric_names:evaluation.metric_names validator:evaluation.validator
run_lock:run_dir.lock remote:run_dir.remote parallelize:step.parallelize
micro_batches:step.micro_batches guards:step.guards gradient_flow:step.gradient_flow
throughput:step.throughput profiling:step.profiling atomic:storage.atomic
hashed_files:storage.hashed_files serialization:storage.serialization
weights:storage.weights snapshot:storage.snapshot frozen_base:storage.frozen_base
hugging_face:storage.hugging_face file_names:storage.file_names
redaction:storage.redaction cache:storage.cache export:tools.export
prediction:tools.prediction lr_finder:tools.lr_finder checklist:tools.checklist
verify_resume:tools.verify_resume run_evaluation:tools.run_evaluation
run_log:tracking.run_log sinks:tracking.sinks console:tracking.console
summary:tracking.summary report:tracking.report runs:tracking.runs
provenance:tracking.provenance launched:tracking.launched data.augment:data.loaders
"""
MOVED = dict(pair.split(":") for pair in MOVED_TEXT.split())


class MovedModules:  # (a meta path finder; importlib.abc takes 10 ms to import)
    """Last on ``sys.meta_path``, asked only for a module no other finder has: an old module
    path (``from glassloop.checkpointer import CheckpointConfig``, as the docs showed until
    2 December) says its new home in its one line instead of a bare ``ModuleNotFoundError``.

    >>> import glassloop
    >>> try:
    ...     import glassloop.checkpointer
    ... except ModuleNotFoundError as err:
    ...     print(str(err).split(": ")[1])
    it moved to glassloop.checkpoint.checkpointer (or import its public names from glassloop)
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        old = fullname.removeprefix("glassloop.")
        if old not in MOVED:
            return None
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: it moved to glassloop.{MOVED[old]} (or import "
            "its public names from glassloop)",
            name=fullname,
        )


if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):  # (once: a reload)
    sys.meta_path.append(MovedModules())
