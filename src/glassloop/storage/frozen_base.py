"""The frozen base of a fine-tuned model: which of its tensors stay out of checkpoints, their
SHA-256, and the check that a resumed (or reloaded) model's base is the one it was trained on.

A model with parameters that do not train (``requires_grad=False``: a peft model's base, a
frozen encoder) saves only what changes: every checkpoint holds the trainable tensors and
buffers, plus the SHA-256 of each frozen tensor, computed once per process. A resume builds
the base the way the run did (``from_pretrained``, a seeded init) and loads the rest; a base
that differs is refused, naming the first tensor that differs. The digests are written into
``meta.json`` under ``"base"``, and into a weights file's metadata (``glassloop.base``).

A parameter frozen when training started but trained later (a layer unfrozen by a callback)
is saved from then on; one frozen later than that was trained before, so it is saved too; a
frozen one the run changes otherwise (an EMA teacher) is noticed and saved: only tensors
frozen now, frozen at the start and unchanged since stay out (:class:`FrozenBase`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.distributed.world import unwrap_model
from glassloop.errors import CheckpointError

METADATA_KEY = "glassloop.base"  # a weights file's metadata: the base it needs


def _frozen(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters that do not train, by state-dict key (a tied parameter under
    each of its names), in state-dict order."""
    tensors = unwrap_model(model).state_dict(keep_vars=True)
    return {
        k: t.detach()
        for k, t in tensors.items()
        if isinstance(t, nn.Parameter) and not t.requires_grad
    }


def tensor_digest(tensor: torch.Tensor) -> str:
    """The SHA-256 of a tensor's dtype, shape and bytes (on the CPU, C order): equal digests
    mean equal tensors, bit for bit."""
    host = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{host.dtype}{list(host.shape)}".encode())
    if host.numel():
        # (bytes through a uint8 view: numpy has no bfloat16; hashlib releases the GIL)
        digest.update(host.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def combined(digests: Mapping[str, str]) -> str:
    """One SHA-256 for the whole base (its names and digests, sorted): what the header and
    the docs call "the base"."""
    text = json.dumps(dict(sorted(digests.items())), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


SAMPLE = 4096  # values per tensor compared at each save to notice a frozen tensor changed


def _mark(tensor: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """How a tensor looks: its storage, its version counter and a copy of a sample of it."""
    return tensor.untyped_storage().data_ptr(), tensor._version, _sample(tensor).clone()


def _sample(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]


def _changed(tensor: torch.Tensor, mark: tuple[int, int, torch.Tensor]) -> bool:
    """Whether ``tensor`` changed since ``mark`` (:func:`_mark`)."""
    where, version, sample = mark
    if tensor.untyped_storage().data_ptr() != where or tensor._version != version:
        return True
    return not torch.equal(_sample(tensor), sample)


def library_of(model: nn.Module) -> str | None:
    """ "peft", "transformers" or ``None``: which library's model ``model`` is (by its class's
    package: importing either to ask costs seconds)."""
    package = type(unwrap_model(model)).__module__.split(".")[0]
    return package if package in ("peft", "transformers") else None


def adapter_alone(model: nn.Module, final_weights: str) -> bool:
    """Whether the final weights leave the frozen base out (``checkpoint.final_weights``:
    "trainable", or "auto" for a peft model)."""
    return final_weights == "trainable" or (final_weights == "auto" and library_of(model) == "peft")


class FrozenBase:
    """The frozen tensors a run leaves out of its checkpoints and their digests.

    The digests are taken when training starts (:meth:`take`), before any step: a tensor
    trained first and frozen later is never taken for the base. A frozen tensor the run still
    changes (an EMA teacher updated in place, even through ``.data``) is seen at each save by
    its storage, its version counter and a sample of its values (every n-th of at most
    :data:`SAMPLE` values, compared on its device: a few ms), and is saved from then on.
    """

    def __init__(self) -> None:
        self.digests: dict[str, str] | None = None  # name -> SHA-256, once taken or loaded
        self._marks: dict[str, tuple[int, int, torch.Tensor]] = {}  # name -> how it looked

    def take(self, model: nn.Module) -> None:
        """The digests of ``model``'s frozen tensors as they are now (once per process: the
        start of training), and how each looks, to notice a change at a save."""
        if self.digests is None:
            frozen = _frozen(model)
            self.digests = {name: tensor_digest(t) for name, t in frozen.items()}
            self._marks = {name: _mark(t) for name, t in frozen.items()}

    def left_out(self, model: nn.Module) -> set[str]:
        """The state-dict keys a checkpoint of ``model`` leaves out now: frozen now, frozen
        at the start, and unchanged since (:meth:`take`, done here if not yet)."""
        self.take(model)
        assert self.digests is not None
        frozen = _frozen(model)
        for name in [n for n in self.digests if n in self._marks]:
            if name not in frozen or _changed(frozen[name], self._marks[name]):
                del self.digests[name], self._marks[name]  # changed or trains: saved from now
        return set(frozen) & set(self.digests)

    def split(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """``model``'s state dict less the base it leaves out now, and that base's record
        (:meth:`meta`; ``None``: nothing left out): what a checkpoint's and an adapter's
        final weights hold."""
        left_out = self.left_out(model)
        tensors = unwrap_model(model).state_dict()
        return {k: t for k, t in tensors.items() if k not in left_out}, self.meta(left_out)

    def meta(self, left_out: set[str]) -> dict[str, Any] | None:
        """What ``meta.json`` records of the base a checkpoint needs (``None``: none)."""
        if not left_out or self.digests is None:
            return None
        needed = {name: self.digests[name] for name in sorted(left_out)}
        return {"sha256": combined(needed), "tensors": needed}

    @staticmethod
    def check(model: nn.Module, base: Any, stored: set[str], source: Path) -> set[str]:
        """Refuse to load a checkpoint (or weights file) at ``source`` whose recorded
        ``base`` (:meth:`meta`) is not ``model``'s: one line naming the first tensor, in the
        model's order, that differs. The tensors ``stored`` in the file are its own; the
        names of those the base supplies are returned."""
        digests = _digests_of(base, source)
        tensors = unwrap_model(model).state_dict()
        needed = {name: sha for name, sha in digests.items() if name not in stored}
        if absent := sorted(set(needed) - set(tensors)):
            name = absent[0]
            raise CheckpointError(
                f"checkpoint: '{source}' was trained on a base with '{name}', which this "
                "model does not have; build the model the run was trained from"
            )
        for name in (name for name in tensors if name in needed):
            expected = needed[name]
            if tensor_digest(tensors[name]) != expected:
                raise CheckpointError(
                    f"checkpoint: '{source}' was trained on another base: '{name}' differs "
                    f"(SHA-256 {expected[:12]}... expected); load the base the run was trained "
                    "on (the same pretrained weights, or the same seed), or start a new run"
                )
        return set(needed)


def recorded_names(base: Any) -> set[str]:
    """The names of the tensors a recorded base (meta.json's or a file's metadata) supplies
    (none for anything that is not such a record: it is refused where it is checked)."""
    try:
        return set(_digests_of(base, Path()))
    except CheckpointError:
        return set()


def _digests_of(base: Any, source: Path) -> dict[str, str]:
    """The ``{name: sha256}`` table of a recorded base (meta.json's or a file's metadata)."""
    if base is None:
        return {}
    if isinstance(base, str):  # a weights file's metadata holds it as JSON text
        try:
            base = json.loads(base)
        except ValueError:
            base = None
    tensors = base.get("tensors") if isinstance(base, dict) else None
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tensors.items()
    ):
        raise CheckpointError(f"checkpoint: '{source}': its record of the base is malformed")
    return dict(tensors)
