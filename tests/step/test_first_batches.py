"""What fit checks on its first batches, before it trains on a mistake: a softmax before
CrossEntropyLoss stops it, a first loss far above ln(C) is said, weights no gradient reaches
are named once (a zero-initialised adapter is not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn


def test_a_softmax_before_cross_entropy_stops_fit_at_the_first_batch() -> None:
    """It trained silently before (81.5% instead of ~97% in two epochs, issue 37): now the
    first-batch guard says so in one line, before any step."""
    import pytest
    import torch
    from torch import nn

    import glassloop

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    before = [p.clone() for p in model.parameters()]
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                nn.CrossEntropyLoss(), progress="none")  # fmt: skip
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    with pytest.raises(glassloop.ModelError) as caught:
        trainer.fit(data, epochs=1)
    assert str(caught.value).startswith(
        "model: its outputs on the first training batch are probabilities (each row in [0, 1], "
        "summing to 1): a softmax before nn.CrossEntropyLoss"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # log-softmax before it changes nothing (log-softmax of log-probabilities: themselves),
    # and NLLLoss takes them as they are: both train.
    for last, loss in ((nn.LogSoftmax(dim=1), nn.CrossEntropyLoss()),
                       (nn.LogSoftmax(dim=1), nn.NLLLoss())):  # fmt: skip
        fine = nn.Sequential(nn.Linear(4, 3), last)
        glassloop.Trainer(fine, torch.optim.SGD(fine.parameters(), lr=0.1), loss,
                          progress="none").fit(data, epochs=1)  # fmt: skip


def test_a_first_loss_far_above_ln_c_is_said_in_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """doctor's "initial loss" check, on the batch fit already looks at (issue 37): a fresh
    classifier far from ln(C) is said in one warning line; a sane one, and a resumed or
    pretrained one below ln(C), says nothing."""
    import torch
    from torch import nn

    import glassloop

    torch.manual_seed(0)
    data = [(torch.randn(32, 6), torch.randint(0, 4, (32,)))]
    for scale, said in ((30.0, True), (1.0, False)):
        model = nn.Linear(6, 4)
        with torch.no_grad():
            model.weight.mul_(scale)  # over-confident from the start
        glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                          nn.CrossEntropyLoss(), progress="lines").fit(data, epochs=1)  # fmt: skip
        out = capsys.readouterr().out
        assert ("warning: the first batch's loss is" in out) is said, out
        if said:
            assert "over twice the ln(4) = 1.386 of an untrained classifier" in out


class _Cut(nn.Module):
    """A model with a layer its forward never uses and one whose gradient it zeroes; a
    zero-initialised branch (LoRA's B, a ReZero residual) whose inputs' gradients are zero
    at the first step only."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.down = nn.Linear(6, 2, bias=False)  # LoRA's A: zero gradient at step 1 only
        self.up = nn.Linear(2, 3, bias=False)
        nn.init.zeros_(self.up.weight)  # LoRA's B
        self.unused = nn.Linear(4, 4)
        self.cut = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x).relu()) + self.up(self.down(x))
        return out + 0 * self.cut(x)  # (its gradient: always zero)


def test_weights_no_gradient_reaches_are_named_once_in_fit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """doctor's "gradient flow" check inside fit (issue 37, item 1): after a fresh run's first
    10 steps, one warning line names the weights that got no gradient (unused) or only zero
    ones (cut off); a zero-initialised adapter's A (a zero gradient at step 1) and frozen
    weights are not named; a resumed run and a healthy model say nothing."""
    import glassloop

    torch.manual_seed(0)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(12)]
    model = _Cut()
    model.body.bias.requires_grad_(False)  # frozen: not named
    trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                nn.CrossEntropyLoss(), progress="none", run_dir=tmp_path / "r",
                                checkpoint=glassloop.CheckpointConfig(every_n_steps=5))  # fmt: skip
    trainer.fit(data, epochs=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if "gradients:" in line]
    assert lines == [
        "warning: gradients: in the first 10 steps, no gradient (unused by the forward) for "
        "'unused.weight', 'unused.bias'; an all-zero gradient for 'cut.weight', 'cut.bias': "
        "they have not learned yet; if they should, find what cuts them off (detach, a dead "
        "ReLU, a layer left out of forward, a learning rate of 0), else freeze them "
        "(requires_grad=False)"
    ]
    again = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              nn.CrossEntropyLoss(), progress="none", run_dir=tmp_path / "r",
                              checkpoint=glassloop.CheckpointConfig(every_n_steps=5))  # fmt: skip
    again.fit(data, epochs=2, resume="auto")  # a resumed run: checked before
    assert "gradients:" not in capsys.readouterr().out
    healthy = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    glassloop.Trainer(healthy, torch.optim.SGD(healthy.parameters(), lr=0.1),
                      nn.CrossEntropyLoss(), progress="none").fit(data, epochs=1)  # fmt: skip
    assert "gradients:" not in capsys.readouterr().out


def test_a_zero_initialised_adapter_trains_and_is_not_named() -> None:
    """LoRA's A gets a zero gradient at the first step (B starts at zero) and a real one from
    the second: the check waits for 10 steps before it names a weight."""
    from glassloop.step.gradient_flow import GradientFlow

    torch.manual_seed(0)
    model = _Cut()
    said: list[str] = []
    flow = GradientFlow(model, said.append)
    flow.start(fresh=True, sharded=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    zero_at_first = None
    for step in range(10):
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 0:
            zero_at_first = bool(model.down.weight.grad.abs().max() == 0)
        flow.check(optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert zero_at_first and not flow.pending
    assert len(said) == 1 and "'down.weight'" not in said[0] and "'cut.weight'" in said[0]
