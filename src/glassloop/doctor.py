"""``glassloop doctor``: the debugging checklist of the reference texts, run in seconds.

Each check prints PASS / WARN / FAIL with one sentence saying what was seen and what to do.
Nothing here trains the run itself: the model is copied for the checks that take steps.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.assemble import Built, build_parts, target_scale_note
from glassloop.batch import split_batch
from glassloop.config import Config
from glassloop.data.splits import Splits
from glassloop.device import move_to_device
from glassloop.lr_finder import range_test
from glassloop.optimizers import optimizer_class


@dataclass
class Check:
    name: str
    status: str  # "PASS", "WARN" or "FAIL"
    message: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<22} {self.message}"


def labels_of(run: Built) -> torch.Tensor:
    data = run.data
    return data.y_train if isinstance(data, Splits) else data.train.labels


def forward(model: nn.Module, batch: Any, device: torch.device) -> tuple[torch.Tensor, Any]:
    (args, kwargs), target = split_batch(move_to_device(batch, device))
    return model(*args, **kwargs), target


def check_labels(run: Built, outputs: int) -> Check:
    y = labels_of(run)
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= outputs:
        return Check(
            "labels",
            "FAIL",
            f"labels range over [{low}, {high}] but the model has "
            f"{outputs} outputs: make labels class indices in [0, {outputs}) or change "
            "the model's output size.",
        )
    return Check("labels", "PASS", f"all {len(y)} training labels are in [0, {outputs}).")


def check_balance(run: Built, outputs: int) -> Check:
    counts = torch.bincount(labels_of(run).clamp(min=0), minlength=outputs)[:outputs]
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        return Check(
            "class balance",
            "WARN",
            f"classes {empty} have no training samples: the "
            "model can never learn them; check the split or the label mapping.",
        )
    ratio = float(counts.max()) / float(counts.min())
    if ratio > 10:
        return Check(
            "class balance",
            "WARN",
            f"the largest class has {ratio:.0f}x the samples of "
            "the smallest: accuracy will flatter the model; weight the loss or resample.",
        )
    return Check("class balance", "PASS", f"largest/smallest class = {ratio:.1f}.")


def check_inputs(run: Built) -> list[Check]:
    data = run.data
    if not isinstance(data, Splits) or not data.x_train.is_floating_point():
        return [Check("inputs", "PASS", "token ids: nothing to normalise.")]
    x = data.x_train
    if not bool(torch.isfinite(x).all()):
        return [
            Check(
                "inputs",
                "FAIL",
                "the training inputs contain NaN or inf: clean or impute them first.",
            )
        ]
    mean, std = float(x.mean()), float(x.std())
    if abs(mean) > 2 or std > 10 or std < 0.05:
        return [
            Check(
                "input scale",
                "WARN",
                f"inputs have mean {mean:.3g} and std {std:.3g}: "
                "standardise them (mean ~0, std ~1) so the default learning rates work.",
            )
        ]
    return [Check("input scale", "PASS", f"inputs have mean {mean:.2f} and std {std:.2f}.")]


def check_softmax(output: torch.Tensor) -> Check:
    if output.ndim != 2 or output.shape[1] < 2:
        return Check("softmax + CE", "PASS", "outputs are not class scores; nothing to check.")
    sums = output.sum(dim=1)
    probabilities = bool(((output >= 0) & (output <= 1)).all()) and bool(
        torch.allclose(sums, torch.ones_like(sums), atol=1e-3)
    )
    log_probabilities = bool((output <= 0).all()) and bool(
        torch.allclose(output.logsumexp(dim=1), torch.zeros_like(sums), atol=1e-3)
    )
    if probabilities or log_probabilities:
        kind = "softmax" if probabilities else "log-softmax"
        return Check(
            "softmax + CE",
            "FAIL",
            f"the model already applies {kind} (rows sum to 1): "
            "CrossEntropyLoss applies log-softmax itself; remove the model's last "
            f"{kind} and return raw logits.",
        )
    return Check(
        "softmax + CE", "PASS", "the model returns raw logits, as CrossEntropyLoss expects."
    )


def check_initial_loss(loss: float, classes: int) -> Check:
    expected = math.log(classes)
    off = abs(loss - expected) / expected
    text = f"{loss:.3f} vs ln({classes}) = {expected:.3f}"
    if off > 1.0:
        return Check(
            "initial loss",
            "FAIL",
            f"{text}: a fresh classifier should be unsure of every "
            "class; check the output layer's initialisation, the loss and the labels.",
        )
    if off > 0.25:
        return Check(
            "initial loss",
            "WARN",
            f"{text}: the fresh model is over-confident; large "
            "initial weights or a biased last layer.",
        )
    return Check("initial loss", "PASS", f"{text}: the fresh classifier is unbiased.")


def check_gradients(model: nn.Module, loss: torch.Tensor) -> Check:
    model.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    dead = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or not bool(p.grad.abs().sum() > 0))
    ]
    model.zero_grad(set_to_none=True)
    if frozen or dead:
        parts = []
        if frozen:
            parts.append(f"frozen (requires_grad=False): {', '.join(frozen[:5])}")
        if dead:
            parts.append(f"no or all-zero gradient: {', '.join(dead[:5])}")
        return Check(
            "gradient flow",
            "FAIL",
            "; ".join(parts) + ". These weights will not learn; unfreeze them, or find what "
            "cuts them off (detach, dead ReLU, unused layer).",
        )
    count = sum(1 for p in model.parameters() if p.requires_grad)
    return Check("gradient flow", "PASS", f"all {count} parameter tensors get a gradient.")


def check_modes(model: nn.Module, batch: Any, device: torch.device) -> Check:
    noisy = [
        m for m in model.modules() if isinstance(m, (nn.Dropout, nn.modules.batchnorm._BatchNorm))
    ]
    if not noisy:
        return Check(
            "train vs eval mode", "PASS", "no dropout or batch-norm: both modes compute the same."
        )
    with torch.no_grad():
        model.train()
        a, _ = forward(model, batch, device)
        model.eval()
        b, _ = forward(model, batch, device)
    diff = float((a - b).abs().max())
    kinds = sorted({type(m).__name__ for m in noisy})
    if diff == 0:
        return Check(
            "train vs eval mode",
            "WARN",
            f"{', '.join(kinds)} present but train and eval outputs are identical: is it active?",
        )
    return Check(
        "train vs eval mode",
        "PASS",
        f"{', '.join(kinds)}: outputs differ by up to {diff:.3g} between modes, so evaluate "
        "after model.eval() (glassloop does).",
    )


def check_target_scale(run: Built) -> Check:
    """A regression's targets against what a fresh model outputs (values near 0)."""
    note = target_scale_note(run.data, run.task)
    if note is None:
        scaled = isinstance(run.data, Splits) and "target_mean" in run.data.preprocessing
        return Check(
            "target scale",
            "PASS",
            "the model learns standardised targets."
            if scaled
            else "targets are near a fresh model's outputs (mean within 3 std, "
            "std between 0.1 and 10).",
        )
    return Check("target scale", "WARN", note.removeprefix("warning: ") + ".")


def check_overfit(run: Built, batch: Any, device: torch.device, steps: int) -> Check:
    model = copy.deepcopy(run.model).to(device).train()
    optimizer = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad] or [torch.zeros(1, requires_grad=True)],
        lr=1e-3,
    )
    loss_fn = run.loss_fn
    first = last = float("nan")
    for step in range(steps):
        logits, target = forward(model, batch, device)
        loss = loss_fn(logits, target)
        if step == 0:
            first = loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item()
        if last < 0.01:
            break
    if last < 0.1 or last < 0.05 * first:
        return Check(
            "overfit one batch",
            "PASS",
            f"loss {first:.3f} -> {last:.4f} in {step + 1} "
            "steps on one batch: the model can learn.",
        )
    if target_scale_note(run.data, run.task) is not None:  # the likelier cause: say so
        return Check(
            "overfit one batch",
            "FAIL",
            f"loss {first:.3f} -> {last:.3f} after {steps} steps on a single batch: the "
            "targets' scale is the likely cause (see 'target scale'): set "
            "data.standardize_targets = true, then look at the model and the loss.",
        )
    return Check(
        "overfit one batch",
        "FAIL",
        f"loss {first:.3f} -> {last:.3f} after {steps} steps "
        "on a single batch: the model cannot fit even that; look for a bug in the model, "
        "the loss or the labels before tuning anything.",
    )


def lr_range_test(run: Built, cfg: Config, device: torch.device, output: Path | None) -> Check:
    """The LR range test (:func:`glassloop.lr_finder.range_test`) on a copy of the model with
    the configured optimizer; draws the curve as a PNG when ``output`` is set."""
    model = copy.deepcopy(run.model).to(device).train()
    cls: Any = optimizer_class(cfg.optim.name)
    optimizer = cls(model.parameters(), lr=1e-7, **cfg.optim.kwargs)
    found = range_test(model, optimizer, run.loss_fn, run.train_loader, device=device)
    where = ""
    if output is not None:
        where = f"; curve in {found.plot(output / 'lr_range.png')}"
    return Check(
        "learning rate",
        "PASS",
        f"range test suggests lr ~ {found.suggestion:.1e} (configured {cfg.optim.lr:.1e}){where}.",
    )


def run_doctor(cfg: Config, *, output: Path | None = None, overfit_steps: int = 300) -> list[Check]:
    """Run every check on the configured model and data; returns the results in order."""
    run = build_parts(cfg)  # the model, loss and data: no optimizer, Trainer or processes
    device = run.device
    model = run.model.to(run.device)
    batch = next(iter(run.train_loader))
    model.eval()
    with torch.no_grad():
        output_eval, _ = forward(model, batch, device)
    classes = int(output_eval.shape[-1])
    classifier = run.task in ("classification", "language-model")
    checks: list[Check] = []
    if classifier:  # class labels, their balance, the logits: only a classifier has them
        checks += [check_labels(run, classes), check_balance(run, classes)]
    checks += check_inputs(run)
    if run.task == "regression":
        checks.append(check_target_scale(run))
    if classifier:
        checks.append(check_softmax(output_eval))
    labels_ok = not classifier or checks[0].status != "FAIL"
    model.train()
    logits, target = forward(model, batch, device)
    if labels_ok:
        loss = run.loss_fn(logits, target)
        if classifier:  # ln(C) is what an untrained classifier's cross-entropy should be
            checks.append(check_initial_loss(float(loss.detach()), classes))
        checks.append(check_gradients(model, loss))
        checks.append(check_overfit(run, batch, device, overfit_steps))
    checks.append(check_modes(model, batch, device))
    if labels_ok:
        checks.append(lr_range_test(run, cfg, device, output))
    return checks


def timed_doctor(cfg: Config, *, output: Path | None = None) -> tuple[list[Check], float]:
    start = time.perf_counter()
    checks = run_doctor(cfg, output=output)
    return checks, time.perf_counter() - start
