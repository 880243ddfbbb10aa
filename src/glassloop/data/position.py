"""Where an epoch of any training loader stands: the batches it iterates from a position (a
resume), from one ``iter()`` of it, and the RNG its order is drawn from, kept in every
checkpoint. A loader with ``state_dict()`` knows its own position; for any other (a
``DataLoader``, a list, a generator of batches) the epoch's order is replayed from the RNG
it was drawn from."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from torch.utils.data import DataLoader

from glassloop.data.hf_datasets import Fitting, fit_loaders
from glassloop.data.loaders import LoaderPosition, close_workers
from glassloop.distributed.preemption import StopRequested, StopSignals
from glassloop.distributed.world import SINGLE, World, check_sharded
from glassloop.rng import capture_rng_state, loader_generators, restore_rng_state

if TYPE_CHECKING:
    from glassloop.state import TrainState


def capture_loader_rng(loader: Any) -> dict[str, Any]:
    """Every RNG an epoch of ``loader`` may draw its order from: the global ones and the
    loader's own generators.

    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(list(range(8)), batch_size=4, shuffle=True)
    >>> saved = capture_loader_rng(loader); first = [b.tolist() for b in loader]
    >>> restore_loader_rng(loader, saved); [b.tolist() for b in loader] == first
    True
    """
    return {
        "global": capture_rng_state(),
        "generators": [g.get_state() for g in loader_generators(loader)],
    }


def restore_loader_rng(loader: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`capture_loader_rng` returned."""
    restore_rng_state(state["global"])
    for generator, saved in zip(loader_generators(loader), state["generators"], strict=False):
        generator.set_state(saved)


def iterate(loader: Iterable[Any]) -> Iterator[Any]:
    """``iter(loader)``, called once, as an iterator that may be iterated again: a loader that
    is its own iterator (its ``__iter__`` starts it over and returns ``self``, as the loader
    Ray's ``prepare_data_loader`` returns) is read by ``next`` alone, since another ``iter()``
    of it (a ``for``, ``itertools.chain``) would start the epoch over: its first batch
    trained twice, or another draw of the global RNG.

    >>> numbers = iterate([1, 2, 3]); next(numbers), list(numbers)
    (1, [2, 3])
    """
    iterator = iter(loader)
    return iterator if iterator is not loader else _each(iterator)


def _each(iterator: Iterator[Any]) -> Iterator[Any]:
    while (batch := next(iterator, _END)) is not _END:
        yield batch


def set_epoch(loader: Any, epoch: int) -> None:
    """Tell ``loader``'s samplers the epoch, as Lightning does: a ``DistributedSampler``
    draws each epoch's order from ``seed + epoch``, the same order every epoch without it (a
    hand-written loop calls ``set_epoch`` itself; ``fit`` is that loop)."""
    batches = getattr(loader, "batch_sampler", None)
    for sampler in getattr(loader, "sampler", None), batches, getattr(batches, "sampler", None):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]


def replay_epoch(
    loader: Iterable[Any], epoch_rng: dict[str, Any] | None, num_batches: int
) -> Iterator[Any]:
    """Continue a loader without ``state_dict`` inside an epoch: with the RNG it drew the
    epoch's order from put back (``epoch_rng``, from :func:`capture_loader_rng` at the
    epoch's start: a ``DataLoader`` draws its shuffle and worker seeds from it), load and
    drop the ``num_batches`` already trained on, then put back the RNG as it was. Exact for a
    ``DataLoader`` and for any loader whose order depends on nothing else.

    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    >>> start = capture_loader_rng(loader); epoch = [b.tolist() for b in loader]
    >>> [b.tolist() for b in replay_epoch(loader, start, 3)] == epoch[3:]
    True
    """
    now = capture_loader_rng(loader)
    if epoch_rng is not None:
        restore_loader_rng(loader, epoch_rng)
    iterator = iterate(loader)
    for _ in itertools.islice(iterator, num_batches):
        pass
    restore_loader_rng(loader, now)
    return iterator


def epoch_batches(
    loader: Iterable[Any],
    epoch_rng: dict[str, Any] | None,
    state: TrainState,
    limit: int = 0,
    signals: StopSignals | None = None,
    window: int = 1,
    world: World = SINGLE,
) -> tuple[Iterator[Any], dict[str, Any] | None]:
    """The batches of the epoch ``state`` is in, from one ``iter(loader)`` (:func:`iterate`),
    and the RNG its order is drawn from (kept in checkpoints); a sampler's ``set_epoch`` is
    called first (:func:`set_epoch`). A loader with ``load_state_dict`` knows its own
    position; another one, ``state.batch_in_epoch`` batches into the epoch (a resume), has
    the rest replayed from ``epoch_rng`` (:func:`replay_epoch`); at an epoch's start its RNG
    is captured. ``limit``: at most this many batches in the epoch (``limit_batches``; a
    resumed one counts those it had done). ``signals``: in one process, a stop signal cuts a
    long wait for a batch short (:func:`waits_cut`; ``window``: the micro-batches of a step).

    >>> from glassloop.state import TrainState
    >>> batches, rng = epoch_batches([1, 2, 3, 4], None, TrainState(batch_in_epoch=1), limit=3)
    >>> list(batches)
    [2, 3]
    """
    set_epoch(loader, state.epoch)  # (a resume: before the order is replayed)
    done, own = state.batch_in_epoch, hasattr(loader, "load_state_dict")
    before = capture_loader_rng(loader)  # (before iter(): what an epoch's first fetch draws)
    if own or not done:
        epoch_rng = epoch_rng if own else before
        batches = iterate(loader)
    else:
        batches = replay_epoch(loader, epoch_rng, done)
    if limit:
        batches = itertools.islice(batches, max(0, limit - done))
    # Not with several processes (they agree on a stop at the next step's collective), nor
    # for a loader with a state_dict() of its own that is not glassloop's (what a cut leaves
    # in it is unknown).
    foreign = hasattr(loader, "state_dict") and not isinstance(loader, LoaderPosition)
    if signals is not None and not world.distributed and not foreign:
        batches = waits_cut(loader, batches, signals, window, before)
    return batches, epoch_rng


def take_loader(
    trainer: Fitting, loader: Iterable[Any], val: Any, batch_size: int | None
) -> tuple[Iterable[Any], Any]:
    """``loader`` (and the validation sets ``val``) as ``fit`` takes them for training: a
    Hugging Face dataset in glassloop's loader (:func:`~glassloop.data.hf_datasets.
    fit_loaders`, ``batch_size`` rows); not all of it in each of several processes
    (:func:`~glassloop.distributed.world.check_sharded`); and, when the loop has not begun (a
    new Trainer), a glassloop loader at the first batch of epoch 0, whatever an earlier
    ``fit``, ``doctor``, ``lr_find`` or a peek left in it, as in a fresh process (a resume
    then loads the saved position). A Trainer that has trained goes on from where its loader
    is: ``fit`` again continues the run."""
    loader, val = fit_loaders(trainer, loader, val, batch_size)
    check_sharded(loader, trainer.world)
    state = trainer.state
    if isinstance(loader, LoaderPosition) and not (state.epoch or state.batch_in_epoch):
        loader.load_state_dict({"epoch": 0, "batches_consumed": 0})
    return loader, val


def replay_caveat(loader: Iterable[Any], batches: int) -> str | None:
    """A warning when resuming ``batches`` into an epoch of a loader whose order glassloop
    cannot restore exactly (``None`` when it can; a loader that knows what its state lacks
    says it: :meth:`~glassloop.data.hf_datasets.StreamedBatches.resume_caveat`)."""
    if callable(own := getattr(loader, "resume_caveat", None)):
        return cast("str | None", own(batches))
    exact = hasattr(loader, "load_state_dict") or isinstance(loader, (DataLoader, list, tuple))
    if not batches or exact:
        return None
    return (
        f"warning: the training loader ({type(loader).__name__}) has no load_state_dict(); "
        f"resuming replays the first {batches} batches of the epoch with the RNG of the "
        "epoch's start, exact only if its order depends on nothing else (glassloop.data "
        "loaders, DataLoader and lists resume exactly)"
    )


def waits_cut(
    loader: Iterable[Any],
    batches: Iterator[Any],
    signals: StopSignals,
    window: int,
    rng: dict[str, Any],
) -> Iterator[Any]:
    """``batches`` (an epoch of ``loader`` in one process), a stop signal that arrives while
    the loop waits for one raising :class:`~glassloop.distributed.preemption.StopRequested`
    at once (``signals.waiting``): a slow loader (a network dataset, workers starting, a cold
    cache) must not outlast a scheduler's grace. The step being gathered (``window``
    micro-batches) is dropped whole and the checkpoint is the last completed step's, so
    what the dropped fetch changed is put back: a glassloop loader's position (three
    integers, read at each window's start) and, in an epoch's first wait, every RNG as it
    was before ``iter()`` (``rng``: a ``DataLoader`` draws its shuffle and worker seeds there).

    Which waits are cut: an epoch's first, always (fetched here, at once); a later one only
    when a loader's worker processes fetch it (a wait that can be long, and leaves the main
    process's RNGs alone: they are not captured at every step, 68 us, more than a small
    step). After its first batch, a loader without workers (in memory: no wait to cut) is
    iterated as it is, with no code of glassloop's between the loop and it."""
    position = loader if isinstance(loader, LoaderPosition) else None
    if workers_of(loader) > 0:
        return _each_wait_cut(loader, batches, signals, window, position, rng)
    first = _cut_fetch(loader, batches, signals, position, where(position), rng)
    return batches if first is _END else itertools.chain((first,), batches)


_END = object()  # (what a fetch returns at an epoch's end)


def where(position: LoaderPosition | None) -> tuple[int, int, int] | None:
    """All a fetch moves of a glassloop loader's position (three integers: no call)."""
    if position is None:
        return None
    return position.epoch, position.batches_consumed, position.sampler.offset


def _cut_fetch(
    loader: Any,
    iterator: Iterator[Any],
    signals: StopSignals,
    position: LoaderPosition | None,
    saved: tuple[int, int, int] | None,
    rng: dict[str, Any] | None,
) -> Any:
    """The next batch (``_END`` at the epoch's end), a stop signal raising at once while it
    is waited for; what the dropped fetch changed is put back first (``saved``: the loader's
    position at the window's start; ``rng``: the RNGs before ``iter()``, an epoch's first)."""
    try:
        signals.waiting = signals.received is None
        try:
            return next(iterator, _END)
        finally:
            signals.waiting = False
    except StopRequested:  # (also one raised as next() returned: the batch is dropped)
        if rng is not None:
            restore_loader_rng(loader, rng)
        if position is not None and saved is not None:
            position.epoch, position.batches_consumed, position.sampler.offset = saved
        close_workers(iterator, at_once=True)
        raise


def _each_wait_cut(
    loader: Any,
    iterator: Iterator[Any],
    signals: StopSignals,
    window: int,
    position: LoaderPosition | None,
    rng: dict[str, Any],
) -> Iterator[Any]:
    """The epoch of a loader with workers, every wait cut (:func:`waits_cut`)."""
    handed = 0
    while True:
        if handed % window == 0:
            saved = where(position)
        batch = _cut_fetch(loader, iterator, signals, position, saved, rng if not handed else None)
        if batch is _END:
            return
        handed += 1
        yield batch


def workers_of(loader: Any) -> int:
    """The worker processes ``loader`` (or the ``DataLoader`` inside a glassloop one) has."""
    inner = getattr(loader, "loader", loader)
    return int(getattr(inner, "num_workers", 0) or 0)


def global_batch(loader: Any, world: World) -> int | None:
    """The samples one micro-batch takes over every process (``batch_size`` x processes),
    recorded in each checkpoint's meta.json; ``None`` for a loader without a batch size."""
    size = getattr(loader, "batch_size", None)
    return size * world.size if isinstance(size, int) and size > 0 else None


def resized_note(
    loader: Any,
    world: World,
    saved: int | None,
    position: dict[str, Any] | None,
    *,
    sharded: bool = False,
) -> str:
    """What a resume on another number of processes does, in words (the end of one line):
    the state, the sample stream, and whether the numbers go on as the uninterrupted run's.

    The run keeps its global batch: glassloop's loaders split it anew
    (:class:`~glassloop.data.loaders.LoaderPosition`); another loader (a ``DataLoader``) is
    iterated as given, so its ``batch_size`` decides and the note says which one keeps it.
    """
    kept, data = _stream_note(loader, world, saved, position or {})
    state = "resharded" if sharded else "loaded whole (every process holds them)"
    same = (
        "; the numbers equal the uninterrupted run's to rounding (gradients add up in "
        "another order), not bit for bit"
        if kept
        else ""
    )
    return (
        f"with {world.size}: the weights and the optimizer state are {state}; {data}; each "
        f"process's RNG is rank 0's (dropout masks differ){same}"
    )


def _stream_note(
    loader: Any, world: World, saved: int | None, state: dict[str, Any]
) -> tuple[bool, str]:
    processes = f"{world.size} process{'es' if world.size > 1 else ''}"
    if saved is None:
        return False, "the global batch of the saved run is not recorded"
    if isinstance(loader, LoaderPosition):
        target = int(state.get("run_batch", saved))
        at = int(state.get("offset", 0)) + int(state.get("batches_consumed", 0)) * saved
        bucketed = getattr(loader, "buckets", None) is not None  # (uneven slices: kept)
        if target % world.size and not bucketed:
            return False, (
                f"the global batch {target} does not divide among {processes}: each takes "
                f"its batch_size {loader.batch_size} (global {loader.batch_size * world.size}) "
                f"from here, the epoch going on at its sample {at}; the steps after it and "
                "their number differ from the uninterrupted run's"
            )
        each = target // world.size
        share = f"{each}" if target % world.size == 0 else f"{each} or {each + 1}"
        return True, (
            f"the global batch {target} is kept ({share} per process), the epoch going on "
            "where it stopped, in the same order"
        )
    size = getattr(loader, "batch_size", None)
    if isinstance(size, int) and size * world.size == saved:
        return True, f"the global batch {saved} is kept ({size} per process)"
    if isinstance(size, int):
        keep = f"batch_size={saved // world.size}" if saved % world.size == 0 else "none"
        return False, (
            f"the training loader's batch_size {size} x {processes} is not the run's global "
            f"batch {saved}: the samples of each step change from here (a loader that keeps "
            f"it: {keep})"
        )
    return False, "the training loader has no batch_size: the global batch cannot be checked"


def keep_global_batch(loader: Any, world: World, meta_file: Path | None) -> None:
    """Before a resume sizes its schedule: a glassloop loader takes the global batch of the
    checkpoint the resume will take (its ``meta_file``) when that was written by another
    number of processes, as its ``load_state_dict`` will, so the steps per epoch and
    a schedule's length are the run's (they were the config's per-process batch times the
    new number of processes, and the resume was refused as a config change)."""
    if meta_file is None or not isinstance(loader, LoaderPosition):
        return
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
        saved, processes = int(meta["global_batch"]), int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # (the resume itself reports what is wrong with it)
    if processes != world.size and saved % world.size == 0:
        loader.resize(saved // world.size)
