"""Training-time image augmentation on whole batches: random horizontal flips and random
crops (pad, then crop back to size), drawn from a generator seeded by ``(seed, epoch,
batch)``, so an augmented run is reproducible and resumes exactly mid-epoch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from glassloop.errors import ConfigError

OPERATIONS = ("hflip", "crop")


class BatchAugment:
    """Augment an image batch ``[B, C, H, W]``; the same ``(epoch, batch)`` always gives the
    same result.

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
