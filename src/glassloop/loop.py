"""The training loop: ``Trainer.fit`` runs epochs; ``Trainer.train_step`` is one optimizer step."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glassloop.batch import Inputs, batch_size_of, describe, split_batch
from glassloop.callbacks import Callback
from glassloop.checkpoint import atomic_path, save_weights
from glassloop.device import move_to_device, resolve_device
from glassloop.errors import DataError, GlassloopError, ModelError
from glassloop.evaluate import LossFn, evaluate, predict
from glassloop.provenance import environment
from glassloop.rng import seed_everything
from glassloop.sinks import ConsoleSink, CSVSink, JSONLSink
from glassloop.state import TrainState

SCHEDULER_INTERVALS = ("epoch", "step")
CSV_FIELDS = ["kind", "epoch", "step", "samples", "train_loss", "loss", "lr", "seconds"]


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``loss_fn`` and evaluates it.

    What ``fit`` does, in order (the code below reads the same way)::

        for epoch in range(epochs):
            model.train()
            for batch in train_loader:              # iterated exactly as given
                x, y = batch moved to device
                loss = loss_fn(model(x), y)         # forward, loss
                loss.backward()                     # backward
                optimizer.step()                    # update
                optimizer.zero_grad()
                scheduler.step() if interval == "step"
            val = evaluate(val_loader)              # eval mode, no grad, mean over samples
            scheduler.step() if interval == "epoch"
            history.append({train_loss, val_loss, val_accuracy, lr, seconds})

    Example::

        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                          nn.CrossEntropyLoss())
        history = trainer.fit(train_loader, val_loader, epochs=10)
        probs = trainer.predict(x_new)

    ``seed`` seeds python/numpy/torch here, after the model was built; to make the initial
    weights reproducible call :func:`glassloop.seed_everything` before building the model.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        scheduler: Any = None,
        scheduler_interval: str = "epoch",
        device: str | torch.device = "auto",
        seed: int | None = None,
        progress: str = "auto",
        log_every: int = 100,
        run_dir: str | Path | None = None,
        callbacks: Sequence[Callback] = (),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if scheduler_interval not in SCHEDULER_INTERVALS:
            raise GlassloopError(
                f"scheduler.interval must be 'epoch' or 'step', got {scheduler_interval!r}"
            )
        if log_every < 1:
            raise GlassloopError(f"train.log_every must be >= 1, got {log_every}")
        if seed is not None:
            seed_everything(seed)
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval
        self.log_every = log_every
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.callbacks = list(callbacks)
        self.config = dict(config) if config is not None else None
        self.console = ConsoleSink(progress)
        self.state = TrainState()
        self.history: list[dict[str, Any]] = []
        self.last_eval: dict[str, Any] | None = None
        self.should_stop = False
        self._sinks: list[CSVSink | JSONLSink] = []

    # ----------------------------------------------------------------------------- the step
    def train_step(self, inputs: Inputs, target: Any) -> torch.Tensor:
        """One optimizer step on one batch; returns the detached loss.

        Override it to change what a step does (Keras-style); ``fit`` stays the same.
        """
        args, kwargs = inputs
        output = self.model(*args, **kwargs)  # forward
        loss = self.loss_fn(output, target)
        loss.backward()  # type: ignore[no-untyped-call]  # gradients accumulate into .grad
        self.optimizer.step()  # exactly torch's step: nothing wrapped, nothing skipped
        self.optimizer.zero_grad(set_to_none=True)  # None frees memory; next backward writes
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()  # once per optimizer step
        return loss.detach()

    # ------------------------------------------------------------------------------ the loop
    def fit(
        self,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None = None,
        *,
        epochs: int,
    ) -> list[dict[str, Any]]:
        """Train for ``epochs`` epochs; return the history, one dict per epoch.

        ``train_loader`` is any iterable of batches (a ``DataLoader``, a list, a generator
        factory re-iterated every epoch) and is iterated exactly as given.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise GlassloopError(f"train.epochs must be a positive integer, got {epochs!r}")
        self.should_stop = False
        self._open_run_dir(val_loader is not None)
        status = "failed"
        try:
            for callback in self.callbacks:
                callback.on_fit_start(self)
            while self.state.epoch < epochs and not self.should_stop:
                row = self._run_epoch(train_loader, val_loader, epochs)
                self.history.append(row)
                for sink in self._sinks:
                    sink.write(row)
                self.console.epoch_end(row, epochs)
                for callback in self.callbacks:
                    callback.on_epoch_end(self, row)
            for callback in self.callbacks:
                callback.on_fit_end(self)
            status = "finished"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.console.close()
            self._close_run_dir(status)
        return self.history

    def _run_epoch(
        self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int
    ) -> dict[str, Any]:
        state = self.state
        epoch = state.epoch + 1
        start = time.perf_counter()
        self.console.epoch_start(epoch, epochs, _num_samples(train_loader))
        self.model.train()  # dropout on, batch-norm updates its running statistics
        losses: list[torch.Tensor] = []
        sizes: list[int] = []
        seen = 0
        batch: Any = None
        state.batch_in_epoch = 0
        try:
            for batch in train_loader:
                inputs, target = split_batch(move_to_device(batch, self.device))
                n = batch_size_of(target, inputs)
                loss = self.train_step(inputs, target)
                losses.append(loss)  # kept on the device: no host sync per step
                sizes.append(n)
                seen += n
                state.step += 1
                state.samples_seen += n
                state.batch_in_epoch += 1
                self.console.advance(n)
                if (state.batch_in_epoch - 1) % self.log_every == 0:
                    self._log_step(loss, seen)
        except (RuntimeError, IndexError, ValueError) as err:
            explained = self._explain(err, batch)
            if explained is err:
                raise
            raise explained from err
        if not losses:
            raise DataError(
                "data: the training loader yielded no batches (an empty dataset, or "
                "batch_size larger than the dataset with drop_last=True)"
            )
        weights = torch.tensor(sizes, dtype=torch.float64, device=self.device)
        train_loss = float(torch.stack(losses).to(torch.float64) @ weights) / seen
        row: dict[str, Any] = {
            "kind": "epoch",
            "epoch": epoch,
            "step": state.step,
            "samples": state.samples_seen,
            "train_loss": train_loss,
        }
        if val_loader is not None:
            self.last_eval = self.evaluate(val_loader)
            row.update({f"val_{k}": v for k, v in self.last_eval.items() if _is_scalar(v)})
        row["lr"] = self.optimizer.param_groups[0]["lr"]
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                self.scheduler.step(row.get("val_loss", train_loss))
            else:
                self.scheduler.step()
        state.epoch = epoch
        state.batch_in_epoch = 0
        row["seconds"] = time.perf_counter() - start
        return row

    def _log_step(self, loss: torch.Tensor, seen_in_epoch: int) -> None:
        value = loss.item()  # a host sync, only every log_every steps
        self.console.log_step(value, seen_in_epoch)
        row = {
            "kind": "step",
            "epoch": self.state.epoch + 1,
            "step": self.state.step,
            "samples": self.state.samples_seen,
            "loss": value,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        for sink in self._sinks:
            sink.write(row)

    def _explain(self, err: Exception, batch: Any) -> Exception:
        """Turn a torch error caused by the user's data or model into one clear line."""
        if isinstance(err, GlassloopError):
            return err
        text = " ".join(str(err).split())
        where = f"epoch {self.state.epoch + 1}, batch {self.state.batch_in_epoch + 1}"
        if "out of bounds" in text and "arget" in text:
            return DataError(
                f"data: a label is outside the model's output range ({text}) at {where}; "
                "labels must be in [0, num_outputs)"
            )
        if self.state.step == 0:
            return ModelError(
                f"model: the first batch {describe(batch)} was rejected by the model or loss: "
                f"{type(err).__name__}: {text}"
            )
        return err

    # ------------------------------------------------------------------------ eval / predict
    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]:
        """Loss (mean over samples), accuracy, confusion matrix and per-class report."""
        return evaluate(self.model, loader, self.loss_fn, device=self.device)

    def predict(self, data: torch.Tensor | Iterable[Any], *, batch_size: int = 256) -> torch.Tensor:
        """Softmax probabilities, on the CPU, under ``torch.inference_mode``."""
        return predict(self.model, data, batch_size=batch_size, device=self.device)

    # ------------------------------------------------------------------------------ run dir
    def _open_run_dir(self, has_val: bool) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.run_dir / "config.json", self.config or self._describe())
        _write_json(self.run_dir / "run.json", {"status": "running", **environment()})
        fields = list(CSV_FIELDS)
        if has_val:
            fields[5:5] = ["val_loss", "val_accuracy"]
        self._sinks = [
            CSVSink(self.run_dir / "metrics.csv", fields),
            JSONLSink(self.run_dir / "metrics.jsonl"),
        ]

    def _close_run_dir(self, status: str) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self.run_dir is None:
            return
        if status == "finished":
            metadata = {"format": "glassloop-weights"}
            if self.config is not None:
                metadata["config"] = json.dumps(self.config)
            save_weights(self.model, self.run_dir / "model.safetensors", metadata)
        info = {"status": status, "step": self.state.step, "epoch": self.state.epoch}
        _write_json(self.run_dir / "run.json", {**info, **environment()})

    def _describe(self) -> dict[str, Any]:
        """The configuration of a run built in Python, for runs without a config file."""
        return {
            "model": type(self.model).__name__,
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "optimizer": type(self.optimizer).__name__,
            "optimizer_defaults": {k: _jsonable(v) for k, v in self.optimizer.defaults.items()},
            "loss_fn": repr(self.loss_fn),
            "scheduler": type(self.scheduler).__name__ if self.scheduler is not None else None,
            "scheduler_interval": self.scheduler_interval,
            "device": str(self.device),
        }


def _num_samples(loader: Iterable[Any]) -> int | None:
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:
        return None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _write_json(path: Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n", encoding="utf-8")
