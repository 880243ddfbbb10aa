"""Several processes: the torchrun world (:mod:`glassloop.distributed.world`: joining its
process group, reductions across ranks, DDP wrapping), FSDP2 sharding and stop signals. The
world's names are re-exported here (``from glassloop.distributed import World``), imported
when first used (PEP 562): the stop signals' module imports no torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "SINGLE",
    "World",
    "agreed_stop",
    "all_reduce",
    "barrier",
    "check_strategy",
    "distributed_job",
    "gather_objects",
    "init_from_env",
    "local_device",
    "shutdown",
    "track_sharded",
    "unwrap_model",
    "world_from_env",
    "wrap",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'glassloop.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module("glassloop.distributed.world"), name)


if TYPE_CHECKING:
    from glassloop.distributed.world import (
        SINGLE,
        World,
        agreed_stop,
        all_reduce,
        barrier,
        check_strategy,
        distributed_job,
        gather_objects,
        init_from_env,
        local_device,
        shutdown,
        track_sharded,
        unwrap_model,
        world_from_env,
        wrap,
    )
