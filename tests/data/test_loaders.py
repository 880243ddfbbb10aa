"""Loaders: resumable mid-epoch, the fast in-memory path, bucketing, dynamic padding."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from glassloop.data import (
    BucketBatchSampler,
    InMemoryLoader,
    ResumableLoader,
    make_loader,
    pad_collate,
)
from glassloop.data.text import padding_fraction
from glassloop.distributed.world import World


def tensors(n: int = 103) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g), torch.arange(n)


def epochs(loader: object, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        out += [batch[1].tolist() for batch in loader]  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("kind", ["fast", "workers-0", "workers-2"])
def test_resume_mid_epoch_gives_the_same_remaining_batches(kind: str) -> None:
    def make() -> InMemoryLoader | ResumableLoader:
        if kind == "fast":
            return InMemoryLoader(tensors(), batch_size=10, seed=3)
        workers = int(kind.split("-")[1])
        return ResumableLoader(
            TensorDataset(*tensors()), batch_size=10, seed=3, num_workers=workers
        )

    full = epochs(make(), 3)
    first = make()
    seen = []
    for _ in range(1):
        seen += [b[1].tolist() for b in first]
    iterator = iter(first)
    seen += [next(iterator)[1].tolist() for _ in range(4)]  # 4 batches into epoch 2
    state = first.state_dict()
    assert state == {"epoch": 1, "batches_consumed": 4, "global_batch": 10, "offset": 0,
                     "processes": 1, "run_batch": 10}  # fmt: skip
    resumed = make()
    resumed.load_state_dict(state)
    seen += epochs(resumed, 2)
    assert seen == full


def test_fast_path_yields_every_sample_once_per_epoch_in_a_seeded_order() -> None:
    x, y = tensors()
    loader = InMemoryLoader((x, y), batch_size=16, shuffle=True, seed=1)
    e1 = [i for batch in loader for i in batch[1].tolist()]
    e2 = [i for batch in loader for i in batch[1].tolist()]
    assert sorted(e1) == sorted(e2) == list(range(103))
    assert e1 != e2 and e1 != list(range(103))  # shuffled, differently each epoch
    again = InMemoryLoader((x, y), batch_size=16, shuffle=True, seed=1)
    assert [i for batch in again for i in batch[1].tolist()] == e1  # seeded
    for xb, yb in InMemoryLoader((x, y), batch_size=16, seed=1):
        assert torch.equal(xb, x[yb])  # rows stay with their labels


def test_fast_path_batches_equal_the_dataloader_path() -> None:
    x, y = tensors()
    fast = make_loader((x, y), batch_size=8, shuffle=True, seed=5)
    slow = make_loader((x, y), batch_size=8, shuffle=True, seed=5, num_workers=2)
    assert isinstance(fast, InMemoryLoader) and isinstance(slow, ResumableLoader)
    for _ in range(2):
        for a, b in zip(fast, slow, strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_global_rng_is_never_touched() -> None:
    state = torch.get_rng_state()
    for loader in (
        make_loader(tensors(), batch_size=8, shuffle=True),
        make_loader(tensors(), batch_size=8, shuffle=True, num_workers=1),
    ):
        list(loader)
    assert torch.equal(state, torch.get_rng_state())


class Sentences(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.arange(1, self.lengths[i] + 1), i % 2


def test_pad_collate_masks_and_token_labels() -> None:
    batch = pad_collate(
        [
            {"input_ids": [4, 5], "labels": [1, 2]},
            {"input_ids": [6, 7, 8, 9], "labels": [3, 4, 5, 6]},
        ]
    )
    assert batch["input_ids"].tolist() == [[4, 5, 0, 0], [6, 7, 8, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[1, 2, -100, -100], [3, 4, 5, 6]]
    assert batch["lengths"].tolist() == [2, 4]


def test_bucketing_cuts_padding_and_keeps_every_sample() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(2000, generator=g) ** 3 * 120 + 2).long().tolist()
    data = Sentences(lengths)
    plain = make_loader(data, batch_size=32, shuffle=True, collate_fn=pad_collate, num_workers=0)
    bucketed = make_loader(
        data, batch_size=32, shuffle=True, collate_fn=pad_collate, num_workers=0, lengths=lengths
    )
    plain_batches, bucket_batches = list(plain), list(bucketed)
    assert padding_fraction(bucket_batches) < 0.5 * padding_fraction(plain_batches)
    assert sorted(int(n) for b in bucket_batches for n in b["lengths"]) == sorted(lengths)
    ids = sorted(i for batch in BucketBatchSampler(lengths, 32, seed=0) for i in batch)
    assert ids == list(range(2000))


def test_bucketed_loader_resumes_mid_epoch() -> None:
    lengths = [(i * 7) % 23 + 1 for i in range(200)]

    def make() -> ResumableLoader:
        return ResumableLoader(
            Sentences(lengths), batch_size=16, seed=2, collate_fn=pad_collate, lengths=lengths
        )

    reference = make()
    full = [b["lengths"].tolist() for _ in range(2) for b in reference]
    first = make()
    iterator = iter(first)
    head = [next(iterator)["lengths"].tolist() for _ in range(5)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = [b["lengths"].tolist() for _ in range(2) for b in resumed]  # rest of epoch 1, epoch 2
    assert head + rest == full


def test_augmentation_is_seeded_per_batch_and_resumes_exactly() -> None:
    from glassloop.data.loaders import BatchAugment

    x = torch.arange(2 * 16.0).view(2, 1, 4, 4).repeat(16, 1, 1, 1)
    y = torch.arange(32)

    def make() -> InMemoryLoader:
        return InMemoryLoader(
            (x, y),
            batch_size=8,
            seed=0,
            augment=BatchAugment(["hflip", "crop"], seed=0, crop_padding=1),
        )

    reference = make()
    batches = [b for _ in range(2) for b in reference]
    full = [b[0] for b in batches]
    assert any(not torch.equal(xb, x[yb]) for xb, yb in batches)  # it changes the images
    assert all(xb.shape == x[yb].shape for xb, yb in batches)
    first = make()
    iterator = iter(first)
    head = [next(iterator)[0] for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = [b[0] for _ in range(2) for b in resumed]
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full, strict=True))


def test_epoch_size_by_arithmetic_equals_the_shard_drawn() -> None:
    from glassloop.data.loaders import EpochSampler
    from glassloop.distributed.world import World

    for n in range(0, 70, 3):
        for size in (1, 2, 3):
            for rank in range(size):
                for shard in ("batches", "strided"):
                    sampler = EpochSampler(
                        n, shuffle=True, seed=0, world=World(rank, size), batch_size=4, shard=shard
                    )
                    assert sampler.epoch_size() == len(sampler.indices()), (n, size, rank, shard)


def steps_of(loaders: list[object], steps: int | None = None) -> list[list[int]]:
    """The global batches (every process's samples, sorted) of ``loaders`` (one per rank)
    iterated together, for ``steps`` steps or to the epoch's end."""
    iterators = [iter(loader) for loader in loaders]  # type: ignore[call-overload]
    out: list[list[int]] = []
    while steps is None or len(out) < steps:
        parts = [next(it, None) for it in iterators]
        if parts[0] is None:
            break
        out.append(sorted(i for part in parts if part is not None for i in part[1].tolist()))
    return out


@pytest.mark.parametrize("kind", ["fast", "workers-0", "buckets"])
@pytest.mark.parametrize("after", [1, 2, 3, 5])
def test_another_number_of_processes_keeps_each_sample_once_per_epoch(
    kind: str, after: int
) -> None:
    """Global batch 24 at 2 processes, 3 steps, then resumed at 1, 2, 3 or 5 processes
    (5: 24 does not divide: glassloop's loaders keep their batch of 12 from the same sample,
    bucketed ones the run's global batches in uneven slices): the rest of the epoch and the
    next two have every sample once; with a divisible number, the same global batches as
    the uninterrupted run. (101 samples: each epoch's short last global batch has at least
    one sample per process, or it would be dropped.)"""

    def make(world: World, batch: int) -> InMemoryLoader | ResumableLoader:
        data = tensors(101)
        if kind == "fast":
            return InMemoryLoader(data, batch_size=batch, shuffle=True, seed=3, world=world)
        lengths = [int(n) % 7 for n in data[1]] if kind == "buckets" else None
        return ResumableLoader(TensorDataset(*data), batch_size=batch, shuffle=True, seed=3,
                               world=world, lengths=lengths)  # fmt: skip

    straight = [make(World(r, 2, r), 12) for r in range(2)]
    reference = [steps_of(straight) for _ in range(3)]
    first = [make(World(r, 2, r), 12) for r in range(2)]
    done = steps_of(first, 3)
    state = first[0].state_dict()
    resumed = [make(World(r, after, r), 12) for r in range(after)]
    for loader in resumed:
        loader.load_state_dict(state)
    epochs_after = [steps_of(resumed) for _ in range(3)]
    for epoch, steps in enumerate([done + epochs_after[0], *epochs_after[1:]]):
        assert sorted(i for step in steps for i in step) == list(range(101)), (after, epoch)
    if (
        24 % after == 0 or kind == "buckets"
    ):  # the run's global batch kept: the same steps as the straight run
        assert [done + epochs_after[0], *epochs_after[1:]] == reference


def test_a_batch_size_changed_on_purpose_stays_and_goes_on_from_the_same_sample() -> None:
    first = InMemoryLoader(tensors(100), batch_size=24, shuffle=True, seed=3)
    seen = [i for batch in steps_of([first], 2) for i in batch]
    resumed = InMemoryLoader(tensors(100), batch_size=32, shuffle=True, seed=3)
    resumed.load_state_dict(first.state_dict())
    rest = steps_of([resumed])
    assert resumed.batch_size == 32 and {len(b) for b in rest[:-1]} == {32}
    assert sorted(seen + [i for batch in rest for i in batch]) == list(range(100))
