"""The debugging checklist of the reference texts, run in seconds: ``glassloop doctor`` on a
config (:func:`run_doctor`) and :func:`glassloop.doctor` on a Trainer built in Python.

Each check prints PASS / WARN / FAIL with one sentence saying what was seen and what to do.
Nothing here trains the run itself: the model is copied for the checks that take steps.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glassloop.batch import split_batch
from glassloop.config.assemble import Built, build_parts, target_scale_note
from glassloop.config.optimizers import optimizer_class
from glassloop.config.schema import Config
from glassloop.data.hf_datasets import loader_for
from glassloop.data.splits import Splits
from glassloop.device import move_to_device
from glassloop.distributed.world import unwrap_model
from glassloop.tasks import class_scores, model_loss, prediction_of
from glassloop.tools.lr_finder import range_test

if TYPE_CHECKING:
    from glassloop.loop import Trainer


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
    return prediction_of(model(*args, **kwargs)), target


def loss_of(
    model: nn.Module, loss_fn: Any, batch: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The prediction, the loss and the target of one forward (``loss_fn=None``: the model's
    own loss, given the target as ``labels=``)."""
    own = loss_fn is None
    (args, kwargs), target = split_batch(move_to_device(batch, device), labels_to_model=own)
    output = model(*args, **kwargs)
    loss = model_loss(output) if own else loss_fn(output, target)
    return prediction_of(output, with_loss=own), loss, target


def check_labels(run: Built | torch.Tensor, outputs: int) -> Check:
    """A config's training labels (or a batch's: ``run`` a tensor) within the outputs."""
    y = run if isinstance(run, torch.Tensor) else labels_of(run)
    low, high = int(y.min()), int(y.max())
    if low < 0 or high >= outputs:
        return Check(
            "labels",
            "FAIL",
            f"labels range over [{low}, {high}] but the model has "
            f"{outputs} outputs: make labels class indices in [0, {outputs}) or change "
            "the model's output size.",
        )
    if low == 1:  # (the classic: labels 1..C for C classes make C + 1 outputs, one never seen)
        return Check(
            "labels",
            "WARN",
            f"labels range over [1, {high}]: class 0 never appears, as with labels counted "
            f"from 1; subtract 1 to make them class indices in [0, {high}).",
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


def check_overfit(
    run: Built | None,
    batch: Any,
    device: torch.device,
    steps: int,
    parts: tuple[nn.Module, Any] | None = None,
) -> Check:
    """Adam on one batch, on a copy of the model: a model that cannot fit it has a bug
    (``parts``: the model and loss of a Trainer, instead of a config's ``run``)."""
    model, loss_fn = parts if parts is not None else (run.model, run.loss_fn)  # type: ignore[union-attr]
    model = copy.deepcopy(model).to(device).train()
    optimizer = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad] or [torch.zeros(1, requires_grad=True)],
        lr=1e-3,
    )
    first = last = float("nan")
    for step in range(steps):
        _, loss, _ = loss_of(model, loss_fn, batch, device)
        if step == 0:
            first = loss.item()
        loss.backward()  # type: ignore[no-untyped-call]
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
    if run is not None and target_scale_note(run.data, run.task) is not None:  # likelier
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
    """The LR range test (:func:`glassloop.tools.lr_finder.range_test`) on a copy of the model with
    the configured optimizer; draws the curve as a PNG when ``output`` is set."""
    model = copy.deepcopy(run.model).to(device).train()
    cls: Any = optimizer_class(cfg.optim.name)
    optimizer = cls(model.parameters(), lr=1e-7, **cfg.optim.kwargs)
    found = range_test(model, optimizer, run.loss_fn, run.train_loader, device=device)
    where = "; --output DIR draws the curve"
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


def doctor(
    trainer: Trainer, loader: Iterable[Any], *, overfit_steps: int = 300, echo: bool = True
) -> list[Check]:
    """The checks of ``glassloop doctor`` for a :class:`~glassloop.Trainer` built in Python, on
    the first batch of ``loader``: the labels within the outputs, no softmax before
    CrossEntropyLoss, the initial loss against ln(C), every trainable weight getting a
    gradient, one batch overfit by Adam, train vs eval mode. On copies of the model: the
    Trainer and its model are unchanged. ``echo``: each check's line printed too.

    >>> import torch, glassloop
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Softmax(dim=1))
    >>> trainer = glassloop.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                             torch.nn.CrossEntropyLoss(), progress="none")
    >>> data = [(torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))]  # (every class)
    >>> [c.status for c in glassloop.doctor(trainer, data, overfit_steps=5, echo=False)][:2]
    ['PASS', 'FAIL']
    """
    device = trainer.device
    model = copy.deepcopy(unwrap_model(trainer.model)).to(device)
    batch = next(iter(loader_for(loader, model=model)))  # (a Hugging Face dataset: a batch)
    loss_fn = trainer.loss_fn
    model.eval()
    with torch.no_grad():
        output, target = forward(model, batch, device)  # (no loss: labels may not fit)
    checks: list[Check] = []
    classifier = trainer.task in ("classification", "language-model")
    scores = class_scores(output, target) if classifier else None
    if scores is not None:
        classes = int(scores[0].shape[-1])
        labels = scores[1][scores[1] != trainer.ignore_index]
        checks.append(check_labels(labels, classes))
        if isinstance(loss_fn, nn.CrossEntropyLoss):
            checks.append(check_softmax(scores[0]))
    labels_ok = not checks or checks[0].status != "FAIL"
    model.train()
    if labels_ok:
        _, loss, _ = loss_of(model, loss_fn, batch, device)
        if scores is not None and isinstance(loss_fn, nn.CrossEntropyLoss):
            checks.append(check_initial_loss(float(loss.detach()), int(scores[0].shape[-1])))
        checks.append(check_gradients(model, loss))
        checks.append(check_overfit(None, batch, device, overfit_steps, parts=(model, loss_fn)))
    if loss_fn is not None:
        checks.append(check_modes(model, batch, device))
    for check in checks if echo else []:
        print(check.line())
    return checks
