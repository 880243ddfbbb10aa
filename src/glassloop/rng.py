"""Seeding, deterministic algorithms, and capture/restore of the python, numpy and torch
(CPU and CUDA) RNG states."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from glassloop.errors import ConfigError


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy's global RNG and torch (CPU and every CUDA device).

    Call it before building the model so that its initial weights are reproducible.

    >>> seed_everything(0); a = torch.rand(1); seed_everything(0)
    >>> bool(torch.equal(a, torch.rand(1)))
    True
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def use_deterministic(mode: bool | str) -> str:
    """``True``: torch's deterministic algorithms (an operation without one raises), cuDNN's
    deterministic kernels without benchmarking, and cuBLAS's fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, unless set; it must be set before CUDA starts);
    ``"warn"``: the same, an operation without a deterministic kernel only warns; ``False``:
    nothing changes. Process-wide settings, as torch's own. What was set ("on", "warn",
    "off"), recorded in run.json."""
    if mode not in (True, False, "warn"):
        raise ConfigError(
            f"config: train.deterministic must be true, false or 'warn', got {mode!r}"
        )
    if mode is False:
        return "off"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return "warn" if mode == "warn" else "on"


def capture_rng_state(loader: Any = None) -> dict[str, Any]:
    """Return the state of every global RNG the loop may draw from (dropout, shuffling) and,
    with ``loader``, of the generators that loader draws its order from
    (``DataLoader(generator=g)``): a resumed process builds its loader and generator afresh,
    and the generator must go on from where the checkpointed one stood, or the resumed
    epochs repeat the first epochs' orders."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if loader is not None:
        state["loader"] = [g.get_state() for g in loader_generators(loader)]
    return state


def restore_rng_state(state: dict[str, Any], loader: Any = None) -> None:
    """Put back what :func:`capture_rng_state` returned (into ``loader``'s generators too)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if loader is not None:
        saved = state.get("loader", [])  # (older checkpoints have none)
        for generator, value in zip(loader_generators(loader), saved, strict=False):
            generator.set_state(value)


def check_rng_state(state: dict[str, Any]) -> None:
    """Raise ``ValueError``/``TypeError`` if :func:`restore_rng_state` would fail on ``state``:
    each part is tried on a throwaway generator, so a bad state is found before anything
    global changes.

    >>> check_rng_state(capture_rng_state())
    >>> check_rng_state({"python": (3, (1, 2), None), "numpy": None, "torch": None})
    Traceback (most recent call last):
    ...
    ValueError: state vector is the wrong size
    """
    random.Random().setstate(state["python"])
    np.random.RandomState().set_state(state["numpy"])
    for saved in [state["torch"], *state.get("loader", [])]:
        torch.Generator().set_state(saved)
    cuda = state.get("cuda")
    if cuda is not None and not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda
    ):
        raise TypeError("cuda RNG states must be uint8 tensors")


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The torch generators a ``DataLoader`` draws its shuffle and worker seeds from when the
    user gave one (``DataLoader(generator=g)``, ``RandomSampler(generator=g)``)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))
    found: list[torch.Generator] = []
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


@contextlib.contextmanager
def held_rng() -> Iterator[None]:
    """The global RNGs (Python's, numpy's, torch's) as they were before the block, whatever
    it drew: for work whose presence depends on something other than the run (a cache that
    was or was not there), so that it cannot change what the run draws next.

    >>> import random
    >>> random.seed(1); before = random.random(); random.seed(1)
    >>> with held_rng():
    ...     _ = random.random()
    >>> random.random() == before
    True
    """
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
