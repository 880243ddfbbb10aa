"""Multi-process training on PyTorch's own engine: torchrun's environment, the process group,
DDP wrapping, each process's own data, and the few collectives the loop needs.

glassloop never launches processes itself: ``torchrun`` (or SLURM through torchrun) starts
one process per device and sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; :func:`init_from_env` joins that group. Everything here is a no-op in a
single process, so the loop calls it unconditionally.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from glassloop.distributed.preemption import STOP_SIGNALS
from glassloop.errors import ConfigError, DataError

WHY_NOT_DATAPARALLEL = (
    "config: train.strategy = 'dp' (torch.nn.DataParallel) is not supported: it runs one "
    "Python process that scatters every batch from GPU 0 and gathers outputs back to it, so "
    "GPU 0 becomes the bottleneck and the GIL serialises the work. glassloop uses "
    "DistributedDataParallel instead: one process per device via torchrun "
    "(glassloop train CONFIG --nproc N), each with its own data shard; see docs/distributed.md"
)


@dataclass(frozen=True)
class World:
    """This process's place in the job: ``rank`` of ``size`` processes, ``local_rank`` of
    ``local_size`` on its node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def several_nodes(self) -> bool:
        return self.size > self.local_size


SINGLE = World()
# The DDP wrappers this process made, so shutdown() can release them (weakly held).
_WRAPPED: weakref.WeakSet[nn.parallel.DistributedDataParallel] = weakref.WeakSet()


def world_from_env() -> World:
    """The world torchrun describes in the environment (one process when it does not)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SINGLE
    local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", size))
    return World(int(os.environ["RANK"]), size, *local)


def check_strategy(strategy: str) -> None:
    """``"auto"``/``"ddp"`` (DDP), ``"fsdp"`` (FSDP2); ``"dp"`` is refused with the reason."""
    if strategy == "dp":
        raise ConfigError(WHY_NOT_DATAPARALLEL)
    if strategy not in ("auto", "ddp", "fsdp"):
        raise ConfigError(
            f"config: train.strategy must be 'auto', 'ddp' or 'fsdp', got {strategy!r}"
        )


def init_from_env(
    device: torch.device, *, strategy: str = "auto", timeout_s: float = 300.0
) -> World:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); pin this process
    to its GPU. Returns the single-process world outside torchrun."""
    check_strategy(strategy)
    world = world_from_env()
    if not world.distributed:
        return world
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(world.local_rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        if restarted() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # A job torchrun restarted shares its agent's store with the attempt before:
            # gloo read the dead processes' addresses from it and failed to connect ("Gloo
            # connectFullMesh failed ... Connection refused", under load). Each attempt
            # gets keys of its own.
            store = dist.PrefixStore(  # type: ignore[attr-defined]
                f"glassloop/attempt-{restarted()}",
                dist.TCPStore(  # type: ignore[attr-defined]
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    world.size,
                    is_master=False,
                    timeout=timeout,
                ),
            )
            dist.init_process_group(
                backend_for(device),
                store=store,
                rank=world.rank,
                world_size=world.size,
                timeout=timeout,
            )
        else:
            dist.init_process_group(backend=backend_for(device), timeout=timeout)
        _beat(world.rank, timeout_s)
        # A script that never leaves the group (the README's own-step example) must not
        # race gloo's teardown at exit (it aborts a process about 1 run in 3).
        atexit.register(shutdown)
    return world


# Each process's heartbeat in the process group's store (glassloop/alive/RANK, from a thread,
# a few times per collective timeout), which shutdown() reads: what stops it, the store, and
# the timeout it was given.
_ALIVE: dict[str, Any] = {}


def _beat(rank: int, timeout_s: float) -> None:
    store = dist.distributed_c10d._get_default_store()
    stop, every = threading.Event(), min(2.0, timeout_s / 4)  # (4+ beats a look, below)

    def beat() -> None:
        while not stop.wait(every):
            try:
                store.add(f"glassloop/alive/{rank}", 1)
            except Exception:  # (the group is gone: nothing to say it to)
                return

    threading.Thread(target=beat, name="glassloop-alive", daemon=True).start()
    _ALIVE.update(stop=stop, store=store, timeout_s=timeout_s)


def arrive_together(name: str, what: str) -> None:
    """Until every process has called ``arrive_together(name, ...)``, however long one works
    alone before it (rank 0 pulling a remote run, or uploading its final files; which the
    training's collective timeout ``train.dist_timeout_s`` never meant to cover), while
    those not there yet beat; one whose heartbeat stopped for a look's ``window`` (the
    timeout, 30 s at most) died, and one that reached :func:`shutdown` instead (an error
    ended it) will not come: an error naming ``what`` it did not reach. The store is
    read at most each second, never waited on with a timeout (its driver logs a warning
    each time one ends). In a group glassloop did not join (no heartbeats): nothing."""
    if "store" not in _ALIVE:
        return
    store, window = _ALIVE["store"], min(float(_ALIVE["timeout_s"]), 30.0)
    size, rank = dist.get_world_size(), dist.get_rank()
    _ALIVE[name] = _ALIVE.get(name, 0) + 1  # (a second fit's pull: keys of its own)
    name = f"{name}-{_ALIVE[name]}" if name != "end" else name
    store.set(f"glassloop/{name}/{rank}", "1")
    store.add(f"glassloop/{name}", 1)
    beats: dict[int, int] = {}
    pause, look = 0.01, time.monotonic() + window
    while store.add(f"glassloop/{name}", 0) < size:
        if time.monotonic() >= look:
            away = [r for r in range(size) if not store.check([f"glassloop/{name}/{r}"])]
            now = {r: store.add(f"glassloop/alive/{r}", 0) for r in away}
            left = [r for r in away if name != "end" and store.check([f"glassloop/end/{r}"])]
            if stopped := left or [r for r in away if now[r] == beats.get(r)]:
                why = "it is ending" if left else f"no heartbeat for {window:.0f} s"
                raise RuntimeError(
                    f"glassloop: the process of rank {stopped[0]} will not reach {what} "
                    f"({why}): see its log"
                )
            beats, look = now, time.monotonic() + window
        threading.Event().wait(pause)
        pause = min(2 * pause, 1.0)


def backend_for(device: torch.device) -> str:
    """The process group's backends: gloo on CPU; on GPUs NCCL for CUDA tensors (gradients,
    metrics kept on the device) and gloo for the small CPU tensors the processes agree on
    (stop signals, sample counts, checkpoint verdicts), which NCCL alone refuses ("No backend
    type associated with device type cpu").

    >>> backend_for(torch.device("cuda"))
    'cpu:gloo,cuda:nccl'
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def local_device(device: torch.device, world: World) -> torch.device:
    """Each process uses its own GPU (``cuda:LOCAL_RANK``); CPU stays CPU."""
    if device.type == "cuda" and world.distributed:
        return torch.device("cuda", world.local_rank)
    return device


def check_sharded(loader: Any, world: World) -> None:
    """Several processes each train on their own part of the data, never each on all of it:
    a training ``DataLoader`` whose samples come from the sampler it made itself
    (``shuffle=True`` or not: every sample, in every process) is refused in one line, and so
    is a glassloop loader built for another number of processes (``make_loader`` without
    ``world=``). Glassloop does not swap the sampler itself, as Lightning does: the order
    would no longer be the one the user built (a one-process run's), nor the samples of a
    step. Any other loader (a sampler or batch sampler of one's own, an ``IterableDataset``
    that splits itself, any iterable of batches) is iterated as given.

    >>> check_sharded(DataLoader(range(8), batch_size=2), World(0, 2))
    Traceback (most recent call last):
    glassloop.errors.DataError: data: the training DataLoader samples the whole dataset ...
    """
    built = getattr(getattr(loader, "sampler", None), "world", None)  # (glassloop's loaders)
    if not world.distributed or (isinstance(built, World) and built.size == world.size):
        return
    processes = f"each of the {world.size} processes would train on all of it"
    if isinstance(built, World):
        raise DataError(
            f"data: the training loader was built for {built.size} process(es) and this job "
            f"has {world.size}, so {processes}; build it with make_loader(..., "
            "world=trainer.world)"
        )
    if not isinstance(loader, DataLoader):
        return
    source = loader.sampler if loader.batch_sampler is None else loader.batch_sampler
    source = source.sampler if type(source) is BatchSampler else source  # (torch's own)
    if type(source) in (SequentialSampler, RandomSampler):  # (exactly: a subclass is yours)
        raise DataError(
            f"data: the training DataLoader samples the whole dataset ({type(source).__name__}"
            f"), so {processes}; give it sampler=DistributedSampler(dataset, num_replicas="
            "trainer.world.size, rank=trainer.world.rank, shuffle=True) (its epoch is set "
            "each epoch), or use glassloop.data.make_loader(..., world=trainer.world)"
        )


def wrap(model: nn.Module, world: World, device: torch.device) -> nn.Module:
    """DDP around ``model`` when there are several processes; the model itself otherwise."""
    if not world.distributed:
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    _WRAPPED.add(ddp)
    return ddp


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``)
    wrappers, so saved keys carry no ``module.`` / ``_orig_mod.`` prefixes."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def distributed_job() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def new_gloo_group() -> Any:
    """A process group of every process over gloo (the default group in one process: none);
    made by every process alike, as any collective."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group(backend="gloo")
    return None


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The sum (or max/min) of ``tensor`` across processes, as a new tensor; ``tensor`` itself
    is never changed (``.cpu()``/``.float()``/``reshape`` of a CPU tensor share its storage:
    reducing in place once doubled the step losses a two-process epoch averages). ``tensor``
    as it is in one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=ops[op])
    return tensor


def gather_objects(value: Any) -> list[Any]:
    """Every process's ``value``, in rank order (``[value]`` in one process).

    Uses ``all_gather_object`` (pickle between our own processes, never from disk)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# The FSDP-sharded models this process made (weakly held), for release_sharded().
_SHARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def track_sharded(model: nn.Module) -> None:
    _SHARDED.add(model)


def release_sharded() -> None:
    """Drop the FSDP state of the sharded models still alive (their parameter groups hold
    the process group): left to the interpreter's teardown, a script that trained with FSDP
    under torchrun aborted after its last line about one exit in seven ("terminate called
    without an active exception", exit code -6: the job failed). A sharded model is not
    usable after this, which at exit no one needs."""
    from torch.distributed._composable.contract import STATE_KEY

    for model in list(_SHARDED):
        for module in model.modules():
            module.__dict__.pop(STATE_KEY, None)
    _SHARDED.clear()
    gc.collect()  # (the states reference each other: free them now, not at teardown)


def shutdown() -> None:
    """Leave the process group together: a barrier first, so no process tears down its
    connections while another still uses them (gloo aborts the process otherwise), once
    every process got here (:func:`arrive_together`: rank 0's final uploads may outlast
    the collective timeout; they timed the others' barrier out, exit 1, in a run that had
    ended well). Then the DDP wrappers still alive let go of their reducer and process
    group: left to the interpreter's own teardown, their C++ destructors aborted a finished
    process about one exit in eight ("terminate called without an active exception"); a
    wrapper is not usable after this, which at exit no one needs."""
    if dist.is_available() and dist.is_initialized():
        try:
            arrive_together("end", "the run's end")
            dist.barrier()
        finally:
            if "stop" in _ALIVE:
                _ALIVE.pop("stop").set()
                _ALIVE.clear()
            for ddp in list(_WRAPPED):
                for name in ("reducer", "process_group", "logger"):
                    ddp.__dict__.pop(name, None)
            _WRAPPED.clear()
            release_sharded()
            dist.destroy_process_group()


def agreed_counts(total: int, samples: int, received: int | None) -> tuple[int, int, int]:
    """``total`` and ``samples`` summed over the processes, and the stop signal any of them
    received (0: none), in one collective (the step's only one before backward): each
    signal is a flag that adds up."""
    got = [float(received == sig) for sig in STOP_SIGNALS]
    totals = all_reduce(torch.tensor([total, samples, *got], dtype=torch.float64))
    signum = next((sig for sig, n in zip(STOP_SIGNALS, totals[2:], strict=True) if n), 0)
    return int(totals[0]), int(totals[1]), int(signum)


def agreed_stop(received: int, more: bool) -> tuple[int, bool]:
    """The stop signal any process received (0: none) and whether any process has another
    batch, in one collective: what a validation agrees on before each batch, so that every
    process abandons it at the same one (:class:`glassloop.evaluation.validator.Abandonable`)."""
    flags = all_reduce(torch.tensor([received, int(more)], dtype=torch.int64), "max")
    return int(flags[0]), bool(flags[1])


def restarted() -> int:
    """How many times torchrun has restarted this job's processes (its elastic mode,
    ``--max-restarts``; 0 for a first start or without torchrun)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0
