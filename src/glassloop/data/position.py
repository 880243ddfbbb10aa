"""Where an epoch of any training loader stands: the batches it iterates from a position (a
resume) and the RNG its order is drawn from, kept in every checkpoint. A loader with
``state_dict()`` knows its own position; for any other (a ``DataLoader``, a list, a
generator of batches) the epoch's order is replayed from the RNG it was drawn from."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from glassloop.data.loaders import LoaderPosition
from glassloop.distributed import World
from glassloop.rng import capture_rng_state, loader_generators, restore_rng_state


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
    iterator = iter(loader)
    for _ in itertools.islice(iterator, num_batches):
        pass
    restore_loader_rng(loader, now)
    return iterator


def epoch_batches(
    loader: Iterable[Any], epoch_rng: dict[str, Any] | None, done: int, limit: int = 0
) -> tuple[Iterable[Any], dict[str, Any] | None]:
    """The batches an epoch iterates and the RNG its order is drawn from (kept in
    checkpoints). A loader with ``load_state_dict`` knows its own position; another one,
    ``done`` batches into an epoch (a resume), has the rest replayed from ``epoch_rng``
    (:func:`replay_epoch`); at an epoch's start its RNG is captured. ``limit``: at most
    this many batches in the epoch (``limit_batches``; a resumed epoch used ``done``).

    >>> batches, rng = epoch_batches([1, 2, 3, 4], None, 1, limit=3)
    >>> list(batches)
    [2, 3]
    """
    batches: Iterable[Any] = loader
    if not hasattr(loader, "load_state_dict"):
        if done:
            batches = replay_epoch(loader, epoch_rng, done)
        else:
            epoch_rng = capture_loader_rng(loader)
    if limit:
        batches = itertools.islice(batches, max(0, limit - done))
    return batches, epoch_rng


def replay_caveat(loader: Iterable[Any], batches: int) -> str | None:
    """A warning when resuming ``batches`` into an epoch of a loader whose order glassloop
    cannot restore exactly (``None`` when it can)."""
    exact = hasattr(loader, "load_state_dict") or isinstance(loader, (DataLoader, list, tuple))
    if not batches or exact:
        return None
    return (
        f"warning: the training loader ({type(loader).__name__}) has no load_state_dict(); "
        f"resuming replays the first {batches} batches of the epoch with the RNG of the "
        "epoch's start, exact only if its order depends on nothing else (glassloop.data "
        "loaders, DataLoader and lists resume exactly)"
    )


def cut_waits(loader: Iterable[Any], world: World) -> tuple[bool, LoaderPosition | None]:
    """Whether a stop signal may cut a wait for ``loader``'s next batch short, and the
    position to put back when it does (:meth:`glassloop.preemption.StopSignals.batches`):
    in one process, for a loader whose position is the loop's count of batches (a
    ``DataLoader``, a list: nothing to put back) or one of glassloop's (two integers). Not
    for another loader with a ``state_dict()`` (what a cut would leave in it is unknown),
    nor with several processes (they agree on a stop at the next step's collective)."""
    if world.distributed:
        return False, None
    if isinstance(loader, LoaderPosition):
        return True, loader
    return not hasattr(loader, "state_dict"), None
