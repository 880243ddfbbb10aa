"""Built-in models (the tutorial MLP) and loading a user's model class from config."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.config.sections import ModelConfig
from glassloop.errors import ModelError


def mlp(
    input_shape: tuple[int, ...], num_classes: int, hidden: list[int], dropout: float = 0.0
) -> nn.Sequential:
    """Flatten → (Linear → ReLU [→ Dropout]) per hidden size → Linear to logits.

    ``mlp((1, 28, 28), 10, [512, 512])`` is the "Learn the Basics" network; no softmax at the
    end, because ``CrossEntropyLoss`` applies log-softmax itself.

    >>> sum(p.numel() for p in mlp((1, 28, 28), 10, [512, 512]).parameters())
    669706
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def cnn(input_shape: tuple[int, ...], num_classes: int, dropout: float = 0.25) -> nn.Sequential:
    """The classic MNIST CNN (PyTorch's examples/mnist): two 3x3 convolutions, max-pooling,
    dropout, a 128-unit hidden layer (about 1.2M parameters at 28x28).

    >>> cnn((1, 28, 28), 10)(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    channels, height, width = input_shape
    flat = 64 * ((height - 4) // 2) * ((width - 4) // 2)
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(dropout),
        nn.Flatten(),
        nn.Linear(flat, 128),
        nn.ReLU(),
        nn.Dropout(2 * dropout),
        nn.Linear(128, num_classes),
    )


class TextClassifier(nn.Module):
    """Embedding → encoder (a GRU, or a small Transformer encoder) → mean over the real
    (unpadded) tokens → linear logits. Takes the batches of ``glassloop.data.pad_collate``.

    >>> model = TextClassifier(vocab_size=50, num_classes=2)
    >>> model(torch.tensor([[5, 6, 0]]), torch.tensor([[1, 1, 0]])).shape
    torch.Size([1, 2])
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        *,
        embed_dim: int = 64,
        encoder: str = "gru",
        num_layers: int = 1,
        num_heads: int = 4,
        dropout: float = 0.0,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        self.kind = encoder
        self.encoder: nn.Module
        if encoder == "gru":
            # Unidirectional: states at real tokens never see the padding that follows them.
            self.encoder = nn.GRU(embed_dim, embed_dim, num_layers=num_layers, batch_first=True)
        else:
            layer = nn.TransformerEncoderLayer(
                embed_dim,
                num_heads,
                dim_feedforward=4 * embed_dim,
                dropout=dropout,
                batch_first=True,
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        mask = attention_mask if attention_mask is not None else (input_ids != self.pad_id).long()
        x = self.embed(input_ids)
        if self.kind == "gru":
            x, _ = self.encoder(x)
        else:
            x = self.encoder(x, src_key_padding_mask=mask == 0)
        weights = mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        logits: torch.Tensor = self.head(self.dropout(pooled))
        return logits


def import_target(target: str) -> Any:
    """Import ``"package.module:Name"`` or ``"path/to/file.py:Name"``."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise ModelError(
            f"model.target {target!r} must look like 'package.module:Class' or "
            "'path/to/file.py:Class'"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ModelError(f"model.target: file '{path}' not found")
            name = f"glassloop_user_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ModelError:
        raise
    except Exception as err:  # the user's module may raise anything while importing
        raise ModelError(
            f"model.target {target!r} could not be imported: {type(err).__name__}: {err}"
        ) from err
    if not hasattr(module, attr):
        raise ModelError(f"model.target {target!r}: module '{module_name}' has no '{attr}'")
    return getattr(module, attr)


def data_kwargs(
    factory: Any, kwargs: dict[str, Any], input_shape: tuple[int, ...], num_outputs: int
) -> dict[str, Any]:
    """``kwargs`` plus what the data says, for each of ``input_shape``, ``num_classes`` and
    ``num_outputs`` that the factory's signature names and ``kwargs`` leaves out (so a
    ``model.target`` class need not repeat them in ``model.kwargs``)."""
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    known = {
        "input_shape": tuple(input_shape),
        "num_classes": num_outputs,
        "num_outputs": num_outputs,
    }
    return {**{k: v for k, v in known.items() if k in accepted and k not in kwargs}, **kwargs}


class TargetScale(nn.Module):
    """A regression model that learns standardised targets (``data.standardize_targets``):
    ``inner`` predicts ``(y - mean) / std`` and this module returns ``y``, in the targets'
    own units, so a fresh model starts at the targets' mean and scale while every loss,
    metric and prediction stays in those units. ``mean``/``std`` (per output, from the
    training split) are buffers: they travel in the weights file.

    >>> scaled = TargetScale(nn.Linear(2, 1, bias=False), [150.0], [80.0])
    >>> _ = nn.init.zeros_(scaled.inner.weight)
    >>> scaled(torch.zeros(1, 2)).item()
    150.0
    """

    def __init__(self, inner: nn.Module, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.inner = inner
        self.target_mean: torch.Tensor
        self.target_std: torch.Tensor
        self.register_buffer("target_mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("target_std", torch.tensor(std, dtype=torch.float32))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = self.inner(*args, **kwargs)
        return out * self.target_std + self.target_mean


def build_model(
    cfg: ModelConfig,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    vocab_size: int = 0,
    pad_id: int = 0,
    target_scale: tuple[list[float], list[float]] | None = None,
) -> nn.Module:
    """The model the config names, for data of ``input_shape`` with ``num_classes`` classes
    (and, for text, a vocabulary of ``vocab_size`` tokens); with ``target_scale`` (mean and
    std per output) inside a :class:`TargetScale`. A built-in model is built on the meta
    device first (no memory): one whose weights would not fit in this machine's memory
    (``hidden = [2**20, 2**20]``: 4 TB) is one line, never an allocation that fails."""
    if not cfg.target and torch.empty(0).device.type != "meta":
        with torch.device("meta"):
            sizes = _build(cfg, input_shape, num_classes, vocab_size=vocab_size, pad_id=pad_id)
        need = sum(p.numel() * p.element_size() for p in sizes.parameters())
        if need > (memory := physical_memory()):
            raise ModelError(
                f"model: the {cfg.name} this config describes has {need / 2**30:,.1f} GiB of "
                f"weights, more than this machine's {memory / 2**30:,.1f} GiB of memory: "
                "check model.hidden (and the data's shape)"
            )
    model = _build(cfg, input_shape, num_classes, vocab_size=vocab_size, pad_id=pad_id)
    return TargetScale(model, *target_scale) if target_scale is not None else model


def physical_memory() -> int:
    """This machine's memory in bytes (unbounded where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # (Windows: no sysconf)
        return 2**63


def target_scale_of(preprocessing: dict[str, Any]) -> tuple[list[float], list[float]] | None:
    """The targets' mean and std a run standardised them with (``None``: it did not)."""
    if "target_mean" not in preprocessing:
        return None
    return list(preprocessing["target_mean"]), list(preprocessing["target_std"])


def _build(
    cfg: ModelConfig,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    vocab_size: int = 0,
    pad_id: int = 0,
) -> nn.Module:
    if cfg.target:
        factory = import_target(cfg.target)
        try:
            model = factory(**data_kwargs(factory, cfg.kwargs, input_shape, num_classes))
        except Exception as err:  # the user's constructor may raise anything
            raise ModelError(
                f"model.target {cfg.target!r} could not be built with kwargs {cfg.kwargs}: "
                f"{type(err).__name__}: {err}"
            ) from err
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"model.target {cfg.target!r} returned {type(model).__name__}, not a torch "
                "nn.Module"
            )
        return model
    try:
        if cfg.name == "mlp":
            return mlp(input_shape, num_classes, cfg.hidden, cfg.dropout)
        if cfg.name == "cnn":
            if len(input_shape) != 3 or min(input_shape[1:]) < 6:
                raise ModelError(
                    f"model: 'cnn' needs images (C, H, W) of at least 6x6, the data is "
                    f"{input_shape}"
                )
            return cnn(input_shape, num_classes, cfg.dropout or 0.25)
        if cfg.name == "text-classifier":
            if not vocab_size:
                raise ModelError(
                    "model: 'text-classifier' needs text data (data.name = 'text-csv')"
                )
            return TextClassifier(
                vocab_size,
                num_classes,
                embed_dim=cfg.embed_dim,
                encoder=cfg.encoder,
                num_layers=cfg.num_layers,
                num_heads=cfg.num_heads,
                dropout=cfg.dropout,
                pad_id=pad_id,
            )
    except (RuntimeError, MemoryError, AssertionError) as err:  # torch's checks, memory
        raise ModelError(
            f"model: '{cfg.name}' could not be built for inputs {input_shape} and "
            f"{num_classes} classes: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
        ) from err
    raise ModelError(
        f"model.name {cfg.name!r} is not a built-in model (built-in: 'mlp', 'cnn', "
        "'text-classifier'); or set "
        "model.target = 'package.module:Class'"
    )
