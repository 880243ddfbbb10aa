"""A resumable training loader and a plain validation loader over in-memory splits.

Why not torchdata's ``StatefulDataLoader``: with torchdata 0.11, a loader shuffling with a
seeded generator, saved and restored into a freshly built one, went on in another order than
the uninterrupted run in 4 of 4 tries (checked again on 2026-12-01; the end-of-epoch restart
bug once cited here, meta-pytorch/data#1437, is fixed by #1439, and #1440 says its shuffling
ignores the global RNG). The state needed here is two
integers: each epoch's order is a permutation drawn from a generator seeded with
``(seed, epoch)``, and the position is the number of batches the loop has consumed, counted
in the main process (so worker prefetching does not matter). Resuming skips indices, never
data: no batch is loaded twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset

from glassloop.data.splits import Splits
from glassloop.distributed.preemption import StopRequested, ignore_stop_signals
from glassloop.distributed.world import SINGLE, World
from glassloop.errors import ConfigError, DataError, GlassloopError


def epoch_seed(seed: int, epoch: int) -> int:
    """A distinct 63-bit seed per (seed, epoch)."""
    return (seed * 1_000_003 + epoch * 7_919 + 12_345) % (2**63 - 1)


OPERATIONS = ("hflip", "crop")


class BatchAugment:
    """Training-time augmentation of an image batch ``[B, C, H, W]``: random horizontal
    flips and random crops (pad, then crop back to size), drawn from a generator seeded by
    ``(seed, epoch, batch)``: an augmented run is reproducible and resumes exactly mid-epoch.

    >>> aug = BatchAugment(["hflip"], seed=0)
    >>> x = torch.arange(4.0).view(1, 1, 1, 4).repeat(8, 1, 1, 1)
    >>> torch.equal(aug(x, epoch=0, batch=0), aug(x, epoch=0, batch=0))
    True
    """

    def __init__(self, operations: Sequence[str], *, seed: int = 0, crop_padding: int = 4) -> None:
        unknown = [op for op in operations if op not in OPERATIONS]
        if unknown:
            raise ConfigError(
                f"config: data.augment: unknown operation(s) {unknown}; known: {list(OPERATIONS)}"
            )
        self.operations = list(operations)
        self.seed = seed
        self.crop_padding = crop_padding

    def __call__(self, x: torch.Tensor, *, epoch: int, batch: int) -> torch.Tensor:
        if x.ndim != 4:
            raise ConfigError(
                f"config: data.augment needs image batches [B, C, H, W], got {tuple(x.shape)}"
            )
        mixed = self.seed * 1_000_003 + epoch * 7_919 + batch * 104_729 + 1
        g = torch.Generator().manual_seed(mixed % (2**63 - 1))
        n, _, h, w = x.shape
        if "hflip" in self.operations:
            flip = (torch.rand(n, generator=g) < 0.5).to(x.device)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        if "crop" in self.operations:
            p = self.crop_padding
            padded = F.pad(x, (p, p, p, p))
            dy = torch.randint(0, 2 * p + 1, (n,), generator=g).tolist()
            dx = torch.randint(0, 2 * p + 1, (n,), generator=g).tolist()
            x = torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])
        return x


class EpochSampler(Sampler[int]):
    """Indices of one epoch: ``randperm`` from a generator seeded by ``(seed, epoch)`` (or
    ``0..n-1`` without shuffling), starting at ``start``. Never touches the global RNG."""

    def __init__(
        self,
        num_samples: int,
        *,
        shuffle: bool,
        seed: int,
        world: World = SINGLE,
        batch_size: int = 1,
        shard: str = "batches",
    ) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.world = world
        self.batch_size = batch_size
        self.shard = shard
        self.epoch = 0
        self.start = 0
        self.offset = 0  # samples of the epoch's order taken before a change of global batch

    def indices(self) -> torch.Tensor:
        """This epoch's remaining indices for this process, as a tensor."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        order = order[self.offset :]
        if self.world.distributed:
            order = self._shard(order)
        return order[self.start :]

    def _shard(self, order: torch.Tensor) -> torch.Tensor:
        """This process's part of the epoch.

        ``"batches"`` (training): global batch ``k`` is ``order[k*B*W : (k+1)*B*W]`` and
        process ``r`` takes its ``r``-th slice of ``B``, so W processes with batch B see
        exactly the samples of one process with batch B*W. The last, short global batch is
        split evenly (sizes differ by at most one); one smaller than W samples is dropped, as
        every process must take the same number of steps. ``"strided"`` (evaluation):
        ``order[rank::W]``, no sample twice, none dropped.
        """
        rank, size = self.world.rank, self.world.size
        if self.shard == "strided":
            return order[rank::size]
        per_step = self.batch_size * size
        full = len(order) // per_step * per_step
        head = order[:full].view(-1, size, self.batch_size)[:, rank].reshape(-1)
        tail = order[full:]
        if len(tail) < size:
            return head
        return torch.cat([head, torch.tensor_split(tail, size)[rank]])

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def epoch_size(self) -> int:
        """Samples this process gets in a full epoch, by arithmetic (no permutation drawn)."""
        n, rank, size = self.num_samples, self.world.rank, self.world.size
        if not self.world.distributed:
            return n
        if self.shard == "strided":
            return len(range(rank, n, size))
        per_step = self.batch_size * size
        full = n // per_step * per_step
        tail = n - full
        # tensor_split gives the first tail % size processes one sample more
        tail_share = 0 if tail < size else tail // size + (rank < tail % size)
        return full // size + tail_share

    def num_batches(self, drop_last: bool) -> int:
        """Batches of ``batch_size`` this process gets in a full epoch."""
        n = self.epoch_size()
        return n // self.batch_size if drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        return self.epoch_size() - self.start


class LoaderPosition:
    """Where a loader stands: its epoch, the batches of it already handed to the loop and
    the global batch they were (``batch_size`` x processes). That is the whole resumable
    state of glassloop's loaders (the order is a function of the seed and the epoch).

    The global batch is what a run keeps when it resumes on another number of processes:
    global batch ``k`` is the same slice of the epoch's order whatever the number of
    processes (:meth:`EpochSampler._shard`), so a loader restored with a different one takes
    ``global // processes`` per process and goes on at the same sample. When it does not
    divide, each process keeps its own ``batch_size`` and the epoch goes on from the same
    sample in the new global batches (``sampler.offset``).

    >>> from glassloop.distributed.world import World
    >>> two = make_loader((torch.arange(12),), batch_size=3, shuffle=True, world=World(0, 2))
    >>> _ = next(iter(two))  # one global batch of 6 (3 per process)
    >>> one = make_loader((torch.arange(12),), batch_size=3, shuffle=True)
    >>> one.load_state_dict(two.state_dict())
    >>> one.batch_size, len(next(iter(one))[0])
    (6, 6)
    """

    epoch: int = 0
    batches_consumed: int = 0
    batch_size: int
    sampler: EpochSampler
    run_batch: int = 0  # the global batch the run started with (0: this one)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.sampler.world.size

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batches_consumed": self.batches_consumed,
            "global_batch": self.global_batch,
            "offset": self.sampler.offset,
            "processes": self.sampler.world.size,
            "run_batch": self.run_batch or self.global_batch,
            **getattr(self.sampler, "version", {}),  # (shards: what the order is drawn from)
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        ours = getattr(self.sampler, "version", {}).get("data_version")
        if state.get("data_version", ours) != ours:
            raise DataError(
                f"data: the shards at {getattr(self.sampler, 'shown', '')} are not those the run "
                "trained on (one added, removed or rewritten since): a resume would mix two data "
                "sets; restore them, or start a new run"
            )
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])
        self.sampler.offset = int(state.get("offset", 0))
        saved = int(state.get("global_batch", self.global_batch))  # (older: as it is)
        self.run_batch = int(state.get("run_batch", saved))
        processes = self.sampler.world.size
        # Another number of processes (only: a batch size changed on purpose stays): the
        # run's global batch split anew when it divides, else this process's own batch.
        if int(state.get("processes", processes)) != processes and self.run_batch % processes == 0:
            self.resize(self.run_batch // processes)
        if self.global_batch != saved:  # the position in samples of the order from here
            self.sampler.offset += self.batches_consumed * saved
            self.batches_consumed = 0

    def resize(self, batch_size: int) -> None:
        """Take ``batch_size`` per process from now on (a resume keeping the global batch)."""
        self.batch_size = self.sampler.batch_size = batch_size

    def finish_epoch(self) -> None:
        """End an epoch the loop stopped early (``limit_batches``): the next iteration starts
        the next epoch's order at its first batch, as after a full epoch (an epoch that ran
        to its end is already finished: nothing changes). Without it a cut epoch resumed
        where it stopped: limited epochs walked through the first epoch's order and
        validation through the validation set, until it came up empty."""
        if self.batches_consumed:
            self.epoch += 1
            self.batches_consumed = self.sampler.offset = 0


class ResumableLoader(LoaderPosition):
    """A ``DataLoader`` whose position (epoch, batches consumed) is a ``state_dict``.

    Iterate it once per epoch like a ``DataLoader``; after ``load_state_dict`` the next
    iteration continues at the exact next batch of the saved epoch.

    >>> data = TensorDataset(torch.arange(10))
    >>> a = ResumableLoader(data, batch_size=3, shuffle=True, seed=0)
    >>> full = [b[0].tolist() for b in a]
    >>> b = ResumableLoader(data, batch_size=3, shuffle=True, seed=0)
    >>> b.load_state_dict({"epoch": 0, "batches_consumed": 2})
    >>> [x[0].tolist() for x in b] == full[2:]
    True
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Any = None,
        lengths: Sequence[int] | None = None,
        world: World = SINGLE,
        shard: str = "batches",
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        # (a dataset that draws its own order a part at a time: data.shards.ShardRows)
        self.sampler = getattr(dataset, "order_sampler", EpochSampler)(
            len(dataset),  # type: ignore[arg-type]
            shuffle=shuffle,
            seed=seed,
            world=world,
            batch_size=batch_size,
            shard=shard,
        )
        # With lengths: batches of similar length (less padding), still resumable by count.
        self.buckets = (
            BucketBatchSampler(
                lengths, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, world=world
            )
            if lengths is not None
            else None
        )
        self.seed = seed
        self.epoch = 0
        self.batches_consumed = 0
        # Worker seeds come from this generator; it is reseeded per epoch in __iter__, so a
        # resumed epoch gives its workers the same seeds as the uninterrupted one.
        self._generator = torch.Generator()
        self._workers = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "collate_fn": collate_fn,
            "generator": self._generator,
            "worker_init_fn": ignore_stop_signals if num_workers > 0 else None,
        }
        self.loader = self._data_loader()

    def _data_loader(self) -> DataLoader[Any]:
        batching: dict[str, Any] = (
            {"batch_sampler": self.buckets}
            if self.buckets is not None
            else {
                "batch_size": self.batch_size,
                "sampler": self.sampler,
                "drop_last": self.drop_last,
            }
        )
        return DataLoader(self.dataset, **batching, **self._workers)

    @property
    def global_batch(self) -> int:
        return super().global_batch if self.buckets is None else self.buckets.global_batch

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.buckets is not None:  # (global batches formed as the run formed them)
            self.buckets.global_batch = int(state.get("run_batch", self.global_batch))
        super().load_state_dict(state)

    def resize(self, batch_size: int) -> None:
        super().resize(batch_size)
        if self.buckets is not None:
            self.buckets.batch_size = batch_size
        self.loader = self._data_loader()  # (a DataLoader's batch size is fixed when built)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.epoch = self.epoch
        self.sampler.start = self.batches_consumed * self.batch_size
        if self.buckets is not None:
            self.buckets.epoch, self.buckets.start = self.epoch, self.batches_consumed
        self._generator.manual_seed(epoch_seed(self.seed, self.epoch) ^ 0x5EED)
        iterator = iter(self.loader)
        try:
            for batch in iterator:
                self.batches_consumed += 1  # counted when handed over, not when prefetched
                yield batch
        except GlassloopError as err:  # raised in a worker: its own line, not the wrapping
            raise type(err)(worker_message(str(err))) from None
        except StopRequested:  # a stop signal cut the wait short: no 5 s per worker either
            close_workers(iterator, at_once=True)
            raise
        finally:  # whatever ends the iteration (an error, a limited epoch): no worker stays
            close_workers(iterator)
        self.epoch += 1
        self.batches_consumed = self.sampler.offset = 0

    def __len__(self) -> int:
        """Batches in a full epoch (of this process)."""
        if self.buckets is not None:
            return self.buckets.num_batches()
        return self.sampler.num_batches(self.drop_last)


def close_workers(iterator: Any, *, at_once: bool = False) -> None:
    """Stop a DataLoader iterator's worker processes now, and kill those that do not stop
    (they ignore SIGTERM, see :func:`glassloop.distributed.preemption.ignore_stop_signals`; one may
    be stuck on a file). Left to garbage collection, an iterator whose epoch ended in an error kept
    its workers alive, and the process then hung at exit joining them. ``at_once``: killed without
    asking (a stop signal's grace has no 5 s per worker to wait)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:  # no worker processes
        return
    workers = list(getattr(iterator, "_workers", ()))
    # (with a pin-memory thread, torch stops it before the workers: a worker killed while it
    # writes could leave it stuck, so that iterator is shut down the usual way)
    at_once = at_once and not hasattr(iterator, "_pin_memory_thread")
    if at_once and getattr(iterator, "_worker_pids_set", False):
        # torch raises "DataLoader worker is killed" from its SIGCHLD handler for a worker
        # it still watches: stop watching first, as its own shutdown does before killing.
        from torch.utils.data._utils import signal_handling

        signal_handling._remove_worker_pids(id(iterator))  # type: ignore[attr-defined]
        iterator._worker_pids_set = False
    for worker in workers if at_once else ():
        if worker.is_alive():
            worker.kill()
    shutdown()  # (asks them to stop, waits up to 5 s each)
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)


def worker_message(text: str) -> str:
    """The error line of an exception re-raised from a DataLoader worker, without the
    "Caught ... in DataLoader worker process N. Original Traceback ..." wrapping.

    >>> worker_message("Caught DataError in DataLoader worker process 0.\\nOriginal "
    ...                "Traceback (most recent call last):\\n  ...\\nglassloop.errors.DataError: "
    ...                "data: bad file")
    'data: bad file'
    """
    if not text.startswith("Caught "):
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of indices of similar length, to reduce padding.

    Each epoch: a seeded shuffle, then chunks of 50 global batches (``batch_size`` x
    processes) are sorted by length and cut into global batches, and those are shuffled (so
    the model does not see lengths in order); each process takes its slice of each global
    batch. Deterministic per ``(seed, epoch)`` and the same global batches for any number of
    processes (a resume on another number keeps them); ``start`` skips batches (resume).

    >>> sampler = BucketBatchSampler([5, 1, 4, 2, 3, 6], batch_size=2, shuffle=False)
    >>> list(sampler)
    [[1, 3], [4, 2], [0, 5]]
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        chunk_batches: int = 50,
        world: World = SINGLE,
    ) -> None:
        self.world = world
        self.lengths = torch.as_tensor(list(lengths))
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.chunk_batches = chunk_batches
        # The run's global batch: kept when a resume has another number of processes, also
        # one it does not divide among (their slices then differ by one sample at most).
        self.global_batch = batch_size * world.size
        self.epoch = 0
        self.start = 0

    def batches(self) -> list[list[int]]:
        n, size = len(self.lengths), self.world.size
        per_step = self.global_batch
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        batches: list[torch.Tensor] = []
        for chunk in torch.split(order, per_step * self.chunk_batches):
            # stable sort: equal lengths keep the shuffled order
            chunk = chunk[torch.sort(self.lengths[chunk], stable=True).indices]
            batches += torch.split(chunk, per_step)
        if self.drop_last and batches and len(batches[-1]) < per_step:
            batches.pop()
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=generator).tolist()
            batches = [batches[i] for i in perm]
        if self.world.distributed:  # every process its slice of each (one per process at least)
            rank = self.world.rank
            batches = [torch.tensor_split(b, size)[rank] for b in batches if len(b) >= size]
        return [b.tolist() for b in batches]

    def num_batches(self) -> int:
        n, size = len(self.lengths), self.world.size
        full, rest = divmod(n, self.global_batch)
        return full + int(bool(rest) and not self.drop_last and rest >= size)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.start :])

    def __len__(self) -> int:
        return self.num_batches() - self.start


class InMemoryLoader(LoaderPosition):
    """The fast path for data already in memory: each batch is ``t[idx]`` for every tensor,
    with ``idx`` a slice of the epoch's seeded permutation — no per-sample ``__getitem__``,
    no collate. Same order as :class:`ResumableLoader` for the same seed (so the same run),
    resumable the same way. ``device="cuda"`` keeps the whole dataset on the GPU.

    >>> x, y = torch.arange(10).float(), torch.arange(10)
    >>> fast = InMemoryLoader((x, y), batch_size=4, shuffle=True, seed=0)
    >>> slow = ResumableLoader(TensorDataset(x, y), batch_size=4, shuffle=True, seed=0)
    >>> all(torch.equal(a[1], b[1]) for a, b in zip(fast, slow))
    True
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        device: torch.device | str | None = None,
        augment: BatchAugment | None = None,
        world: World = SINGLE,
        shard: str = "batches",
    ) -> None:
        sizes = {len(t) for t in tensors}
        if len(sizes) != 1:
            raise ValueError(f"all tensors need the same first dimension, got {sorted(sizes)}")
        self.tensors = tuple(t.to(device) if device is not None else t for t in tensors)
        self.dataset = TensorDataset(*self.tensors)  # for len() and for code that inspects it
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = EpochSampler(
            len(self.dataset),
            shuffle=shuffle,
            seed=seed,
            world=world,
            batch_size=batch_size,
            shard=shard,
        )
        self.augment = augment  # applied to the first tensor (the inputs) of each batch
        self.epoch = 0
        self.batches_consumed = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self.sampler.epoch = self.epoch
        self.sampler.start = self.batches_consumed * self.batch_size
        order = self.sampler.indices().to(self.tensors[0].device)
        # (split of an empty order yields one empty chunk: a resume at an epoch's last batch
        # must yield nothing, not one empty batch)
        for idx in torch.split(order, self.batch_size) if len(order) else ():
            if self.drop_last and len(idx) < self.batch_size:
                break
            batch = tuple(t[idx] for t in self.tensors)
            if self.augment is not None:
                x = self.augment(batch[0], epoch=self.epoch, batch=self.batches_consumed)
                batch = (x, *batch[1:])
            self.batches_consumed += 1
            yield batch
        self.epoch += 1
        self.batches_consumed = self.sampler.offset = 0

    def __len__(self) -> int:
        """Batches in a full epoch (of this process)."""
        return self.sampler.num_batches(self.drop_last)


def make_loader(
    dataset: Dataset[Any] | Sequence[torch.Tensor],
    *,
    batch_size: int,
    shuffle: bool = False,
    drop_last: bool = False,
    num_workers: int | str = "auto",
    pin_memory: bool | str = "auto",
    seed: int = 0,
    collate_fn: Any = None,
    lengths: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    world: World = SINGLE,
    shard: str = "batches",
) -> InMemoryLoader | ResumableLoader:
    """A resumable loader with sensible defaults.

    * Tensors in memory (a ``TensorDataset`` or a tuple of tensors) and ``num_workers`` 0 or
      ``"auto"``: the fast path, :class:`InMemoryLoader` (``device`` may keep it on the GPU).
    * Anything else: :class:`ResumableLoader` over a ``DataLoader``; ``num_workers="auto"``
      is ``min(4, CPUs - 1)``; ``pin_memory="auto"`` pins when CUDA is available; workers get
      per-epoch seeds from ``(seed, epoch)`` and ignore SIGTERM/SIGINT. With ``lengths``,
      batches are bucketed by length (see :class:`BucketBatchSampler`).

    >>> loader = make_loader((torch.zeros(10, 3), torch.zeros(10)), batch_size=4)
    >>> type(loader).__name__, len(loader)
    ('InMemoryLoader', 3)
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise DataError(
            f"data: make_loader needs a dataset with a length and indexing (map-style) to "
            f"shuffle, shard and resume it; {type(dataset).__name__} has no length. Pass "
            "DataLoader(dataset, batch_size=...) to fit instead (a resume then replays the "
            "epoch's batches, exact when the dataset yields the same items in the same order)"
        )
    tensors: Sequence[torch.Tensor] | None = None
    if isinstance(dataset, TensorDataset):
        tensors = dataset.tensors
    elif isinstance(dataset, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in dataset):
        tensors = dataset
    if (
        tensors is not None
        and num_workers in (0, "auto")
        and lengths is None
        and collate_fn is None
    ):
        return InMemoryLoader(
            tensors,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            device=device,
            world=world,
            shard=shard,
        )
    if tensors is not None:
        dataset = TensorDataset(*tensors)
    if num_workers == "auto":
        num_workers = min(4, max(0, (os.cpu_count() or 1) - 1))
    if pin_memory == "auto":
        pin_memory = torch.cuda.is_available()
    return ResumableLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        num_workers=int(num_workers),
        pin_memory=bool(pin_memory),
        collate_fn=collate_fn,
        lengths=lengths,
        world=world,
        shard=shard,
    )


def loaders_for_splits(
    splits: Splits,
    *,
    batch_size: int,
    eval_batch_size: int | None = None,
    shuffle: bool = True,
    num_workers: int = 0,
    seed: int = 0,
    device: torch.device | str | None = None,
    augment: Sequence[str] = (),
    world: World = SINGLE,
) -> tuple[InMemoryLoader | ResumableLoader, InMemoryLoader | ResumableLoader]:
    """Training loader (shuffled per epoch from ``seed``) and validation loader for in-memory
    splits: the fast path, or worker processes when ``num_workers > 0``.

    >>> from glassloop.config.schema import DataConfig
    >>> from glassloop.data import load_splits
    >>> train, val = loaders_for_splits(load_splits(DataConfig(name="synthetic")), batch_size=32)
    >>> next(iter(train))[0].shape
    torch.Size([32, 32])
    """
    pin = device is not None and torch.device(device).type == "cuda"
    common: dict[str, Any] = {
        "num_workers": num_workers,
        "pin_memory": pin,
        "seed": seed,
        "world": world,
    }
    train = make_loader(
        (splits.x_train, splits.y_train), batch_size=batch_size, shuffle=shuffle, **common
    )
    if augment:
        if not isinstance(train, InMemoryLoader):
            raise ConfigError(
                "config: data.augment works on the in-memory path: data.num_workers = 0"
            )
        train.augment = BatchAugment(augment, seed=seed)
    val = make_loader(
        (splits.x_val, splits.y_val),
        batch_size=eval_batch_size or batch_size,
        shard="strided",
        **common,
    )
    return train, val
