"""Accumulation, precision, clipping, non-finite policy, schedules, early stopping, EMA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from glassloop import Trainer
from glassloop.callbacks import EarlyStopping
from glassloop.data import ResumableLoader
from glassloop.errors import NonFiniteError
from glassloop.step.guards import NonFinitePolicy


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was asked to apply."""

    def __init__(self, params: Any, lr: float = 0.0) -> None:
        super().__init__(params, lr=lr)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def grads_of(
    model: nn.Module, batches: list[Any], loss_fn: Any, **options: Any
) -> list[torch.Tensor]:
    optimizer = RecordingSGD(model.parameters())
    trainer = Trainer(model, optimizer, loss_fn, device="cpu", progress="none", **options)
    trainer.fit(batches, epochs=1)
    assert len(optimizer.grads) == 1, "expected exactly one optimizer step"
    return optimizer.grads[0]


def test_accumulated_window_equals_one_big_batch_including_a_partial_window() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    # Micro-batches of 3, 3, 3 and 1 samples: one window of four, the last micro-batch short.
    micro = [(x[i : i + 3], y[i : i + 3]) for i in range(0, 10, 3)]
    accumulated = grads_of(model, micro, nn.CrossEntropyLoss(), grad_accum_steps=4)
    big = grads_of(model, [(x, y)], nn.CrossEntropyLoss())
    for a, b in zip(accumulated, big, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    # A fixed divisor (loss / 4, what most trainers do) would be wrong here:
    naive = [g * 0 for g in big]
    model.zero_grad()
    for xb, yb in micro:
        (nn.CrossEntropyLoss()(model(xb), yb) / 4).backward()
    naive = [p.grad.clone() for p in model.parameters()]
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(naive, big, strict=True))


def test_last_partial_window_of_an_epoch_is_weighted_by_its_samples() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(7, 4), torch.randint(0, 2, (7,))
    micro = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 7, 2)]  # 2, 2, 2, 1
    optimizer = RecordingSGD(model.parameters())
    Trainer(
        model, optimizer, nn.CrossEntropyLoss(), device="cpu", progress="none", grad_accum_steps=3
    ).fit(micro, epochs=1)
    assert len(optimizer.grads) == 2  # a window of three, then a window of one
    last = optimizer.grads[1]
    model.zero_grad()
    nn.CrossEntropyLoss()(model(x[6:]), y[6:]).backward()
    assert all(
        torch.allclose(a, p.grad, atol=1e-7) for a, p in zip(last, model.parameters(), strict=True)
    )


class TinyTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_token_weighted_accumulation_with_ragged_sequences() -> None:
    torch.manual_seed(0)
    lengths = [7, 2, 5, 1, 6, 3]
    tokens = torch.zeros(6, 7, dtype=torch.long)
    labels = torch.full((6, 7), -100)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, 20, (n,))
        labels[i, :n] = torch.randint(0, 4, (n,))
    model = TinyTagger()
    micro = [(tokens[i : i + 2], labels[i : i + 2]) for i in range(0, 6, 2)]  # 9, 6, 9 tokens
    accumulated = grads_of(model, micro, token_loss, grad_accum_steps=3, loss_weighting="tokens")
    big = grads_of(model, [(tokens, labels)], token_loss)
    for a, b in zip(accumulated, big, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    by_samples = grads_of(model, micro, token_loss, grad_accum_steps=3)
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(by_samples, big, strict=True))


def blobs(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 2 * F.one_hot(y, 8).float()
    return TensorDataset(x, y)


def make(run_dir: Path | None = None, **options: Any) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
        run_dir=run_dir,
        **options,
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes_exactly(tmp_path: Path, precision: str) -> None:
    def loader() -> ResumableLoader:
        return ResumableLoader(blobs(), batch_size=32, seed=0)

    full = make(tmp_path / "full", precision=precision)
    history = full.fit(loader(), epochs=4)
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]  # it learns
    if precision == "fp16":
        assert full.scaler is not None and full.state_dict()["scaler"]["scale"] > 0

    first = make(tmp_path / "split", precision=precision)
    first.fit(loader(), epochs=2)
    second = make(tmp_path / "split", precision=precision)
    second.fit(loader(), epochs=4, resume="auto")
    for key, value in full.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[key]), key
    if precision == "fp16":
        assert second.scaler is not None and full.scaler is not None
        assert second.scaler.state_dict() == full.scaler.state_dict()


def nan_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = blobs(80)
    x, y = data.tensors[0].clone(), data.tensors[1]
    x[35, 2] = float("nan")  # in batch 4 (samples 30..39)
    return [(x[i : i + 10], y[i : i + 10]) for i in range(0, 80, 10)]


def test_nonfinite_strict_names_step_and_parameter() -> None:
    trainer = make(nonfinite="strict")
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(nan_batches(), epochs=1)
    message = str(info.value)
    assert "loss is nan at step 4 (epoch 1, batch 4)" in message
    assert "first non-finite gradient: '0.weight'" in message
    assert trainer.state.step == 3


def test_nonfinite_skip_drops_the_step_and_does_not_advance_the_scheduler() -> None:
    trainer = make(nonfinite="skip")
    trainer.scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1)
    trainer.scheduler_interval = "step"
    history = trainer.fit(nan_batches(), epochs=1)
    assert trainer.state.step == 7 and trainer.state.skipped_steps == 1
    assert trainer.scheduler.last_epoch == 7
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert history[0]["train_loss"] == history[0]["train_loss"]  # not NaN


def test_nonfinite_skip_stops_after_too_many_in_a_row() -> None:
    batches = nan_batches()
    # The first batch is clean (a NaN there is refused up front); then NaN after NaN.
    poisoned = batches[:1] + [(torch.full_like(x, float("nan")), y) for x, y in batches[1:]]
    with pytest.raises(NonFiniteError, match="3 non-finite steps in a row"):
        make(nonfinite=NonFinitePolicy("skip", max_skips=3)).fit(poisoned, epochs=1)


def test_scheduler_steps_once_per_optimizer_step_with_accumulation() -> None:
    trainer = make(grad_accum_steps=3)
    trainer.scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=1)
    trainer.scheduler_interval = "step"
    trainer.fit(DataLoader(blobs(), batch_size=32), epochs=2)  # 8 batches: windows 3, 3, 2
    assert trainer.state.step == 6
    assert trainer.scheduler.last_epoch == 6


def test_reduce_lr_on_plateau_steps_on_the_validation_loss() -> None:
    trainer = make()
    # threshold=10 in "rel" mode: nothing counts as an improvement, so every epoch after the
    # first is a plateau and the lr drops by 10x.
    trainer.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        trainer.optimizer, patience=0, factor=0.1, threshold=10
    )
    history = trainer.fit(DataLoader(blobs(), batch_size=64), DataLoader(blobs(64)), epochs=3)
    assert [round(row["lr"], 8) for row in history] == [1e-2, 1e-3, 1e-4]


def test_early_stopping_stops_and_its_state_is_checkpointed(tmp_path: Path) -> None:
    stop = EarlyStopping("val_loss", patience=2, min_delta=100.0)  # nothing improves by 100
    trainer = make(tmp_path, callbacks=[stop])
    history = trainer.fit(
        ResumableLoader(blobs(), batch_size=64, seed=0), DataLoader(blobs(64)), epochs=10
    )
    assert len(history) == 3 and stop.stopped_epoch == 3
    assert trainer.state_dict()["callbacks"] == [
        {
            "best": history[0]["val_loss"],
            "bad_epochs": 2,
            "stopped_epoch": 3,
            "watched": ["val_loss", "min"],
        }
    ]


def test_ema_is_evaluated_and_exported(tmp_path: Path) -> None:
    trainer = make(tmp_path, ema_decay=0.9)
    trainer.fit(ResumableLoader(blobs(), batch_size=32, seed=0), DataLoader(blobs(64)), epochs=2)
    ema, raw = trainer.eval_model, trainer.model
    assert ema is not raw
    assert not torch.equal(ema.state_dict()["0.weight"], raw.state_dict()["0.weight"])
    from glassloop import evaluate, load_weights

    assert (
        trainer.evaluate(DataLoader(blobs(64)))["loss"]
        == evaluate(ema, DataLoader(blobs(64)), nn.CrossEntropyLoss())["loss"]
    )
    copy = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    load_weights(copy, tmp_path / "model.safetensors")
    assert torch.equal(copy.state_dict()["0.weight"], ema.state_dict()["0.weight"])


def test_clipping_bounds_the_update_and_logs_the_pre_clip_norm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        nn.CrossEntropyLoss(),
        device="cpu",
        progress="none",
        clip_grad_norm=1e-3,
        run_dir=tmp_path,
    )
    x, y = blobs(16).tensors
    trainer.fit([(x * 100, y)], epochs=1)
    delta = torch.cat(
        [(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]
    )
    assert delta.norm() <= 1e-3 * (1 + 1e-5)
    import json

    step_row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert step_row["grad_norm"] > 1e-3


def test_compiled_checkpoints_resume_without_compile_and_back(tmp_path: Path) -> None:
    def loader() -> ResumableLoader:
        return ResumableLoader(blobs(64), batch_size=32, seed=0)

    compiled = make(tmp_path, compile=True)
    assert hasattr(compiled.model, "_orig_mod")  # really compiled
    compiled.fit(loader(), epochs=1)
    from glassloop.storage.weights import read_safetensors_header

    keys = set(read_safetensors_header(tmp_path / "model.safetensors")) - {"__metadata__"}
    assert keys == {"0.weight", "0.bias", "3.weight", "3.bias"}  # no "_orig_mod." prefix
    plain = make(tmp_path)  # resumes the compiled run's checkpoint without compile
    plain.fit(loader(), epochs=2, resume="auto")
    assert plain.state.epoch == 2
    again = make(tmp_path, compile=True)  # and a compiled trainer resumes the plain one
    again.fit(loader(), epochs=3, resume="auto")
    assert again.state.epoch == 3
    for key, value in plain.model.state_dict().items():
        assert value.shape == again.model.state_dict()["_orig_mod." + key].shape
