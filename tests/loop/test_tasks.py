"""Any model, any task: regression, multilabel, language models, dict/tuple/ModelOutput
outputs, a model's own loss, multi-input predict, custom metrics, step hooks, lr_find."""

from __future__ import annotations

import copy
import csv
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from sklearn import metrics as skm
from torch import nn
from torch.nn import functional as F
from torch.utils.data import IterableDataset

import glassloop
from glassloop import Callback, ConfigError, DataError, Trainer
from glassloop.data import make_loader


def regression_data(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0], [3.0]]) + 0.1 * torch.randn(
        n, 1, generator=g
    )
    return x, y


def trainer_for(model: nn.Module, loss_fn: Any, lr: float = 0.05, **kwargs: Any) -> Trainer:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return Trainer(model, optimizer, loss_fn, device="cpu", progress="none", **kwargs)


# ----------------------------------------------------------------------------- regression
def test_regression_predicts_raw_values_and_reports_sklearn_metrics() -> None:
    torch.manual_seed(0)
    x, y = regression_data()
    model = nn.Linear(5, 1)
    trainer = trainer_for(model, nn.MSELoss())
    assert trainer.task == "regression"
    loader = make_loader((x, y), batch_size=32, shuffle=True)
    history = trainer.fit(loader, make_loader((x, y), batch_size=50), epochs=3)
    prediction = trainer.predict(x)
    assert prediction.shape == (256, 1)
    assert not torch.allclose(prediction, torch.ones_like(prediction))  # not a softmax
    expected = model(x).detach()
    assert torch.allclose(prediction, expected, atol=1e-6)
    row = history[-1]
    p, t = expected.numpy(), y.numpy()
    assert row["val_mae"] == pytest.approx(skm.mean_absolute_error(t, p), rel=1e-5)
    assert row["val_rmse"] == pytest.approx(skm.root_mean_squared_error(t, p), rel=1e-5)
    assert row["val_r2"] == pytest.approx(skm.r2_score(t, p), rel=1e-5)
    assert "val_accuracy" not in row


def test_regression_r2_and_rmse_average_over_outputs_like_sklearn() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.randn(40, 3, generator=g, dtype=torch.float64)
    t = torch.randn(40, 3, generator=g, dtype=torch.float64)
    result = glassloop.evaluate(nn.Identity(), [(p[:25], t[:25]), (p[25:], t[25:])], nn.MSELoss())
    assert result["r2"] == pytest.approx(skm.r2_score(t.numpy(), p.numpy()), rel=1e-9)
    assert result["rmse"] == pytest.approx(skm.root_mean_squared_error(t, p), rel=1e-9)
    assert result["mae"] == pytest.approx(skm.mean_absolute_error(t, p), rel=1e-9)


def test_regression_target_shape_that_would_broadcast_is_a_clear_error() -> None:
    x, y = regression_data()
    trainer = trainer_for(nn.Linear(5, 1), nn.MSELoss())
    with pytest.raises(DataError, match=r"output has shape \(32, 1\) and the target \(32,\)"):
        trainer.fit(make_loader((x, y.squeeze(1)), batch_size=32), epochs=1)


# ----------------------------------------------------------------------------- multilabel
def test_multilabel_sigmoid_predictions_and_metrics_equal_sklearn() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 8, generator=g)
    y = (x[:, :4] + 0.3 * torch.randn(300, 4, generator=g) > 0).float()
    model = nn.Linear(8, 4)
    trainer = trainer_for(model, nn.BCEWithLogitsLoss(), lr=1.0, metrics=["auroc", "f1_weighted"])
    assert trainer.task == "multilabel"
    history = trainer.fit(
        make_loader((x, y), batch_size=32), make_loader((x, y), batch_size=64), epochs=5
    )
    probs = trainer.predict(x)
    assert torch.allclose(probs, torch.sigmoid(model(x)).detach(), atol=1e-6)
    predicted = (probs > 0.5).int().numpy()
    truth = y.int().numpy()
    row = history[-1]
    assert row["val_accuracy"] == pytest.approx(1 - skm.hamming_loss(truth, predicted))
    assert row["val_exact_match"] == pytest.approx(skm.accuracy_score(truth, predicted))
    assert row["val_f1_micro"] == pytest.approx(skm.f1_score(truth, predicted, average="micro"))
    assert row["val_f1_macro"] == pytest.approx(skm.f1_score(truth, predicted, average="macro"))
    assert row["val_f1_weighted"] == pytest.approx(
        skm.f1_score(truth, predicted, average="weighted"), rel=1e-5
    )
    assert row["val_auroc"] == pytest.approx(
        skm.roc_auc_score(truth, probs.numpy(), average="macro"), rel=1e-4
    )
    assert row["val_accuracy"] > 0.8


# ------------------------------------------------------------------- classification extras
def test_a_sigmoid_model_with_bce_loss_predicts_probabilities_and_reports_accuracy() -> None:
    """BCELoss (task left to "auto"): the outputs are probabilities already. A softmax over
    its one column made every prediction 1.0 and no accuracy was reported."""
    torch.manual_seed(0)
    x = torch.randn(200, 4)
    y = (x[:, :1] + x[:, 1:2] > 0).float()
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    trainer = trainer_for(model, nn.BCELoss(), lr=0.5)
    assert trainer.task == "multilabel"
    history = trainer.fit(
        make_loader((x, y), batch_size=20), make_loader((x, y), batch_size=64), epochs=3
    )
    probs = trainer.predict(x)
    expected = model(x).detach()
    assert torch.allclose(probs, expected, atol=1e-6)  # as they are: no sigmoid, no softmax
    assert float(probs.min()) > 0 and float(probs.max()) < 1
    truth, decided = y.numpy().astype(int), (expected.numpy() > 0.5).astype(int)
    assert history[-1]["val_accuracy"] == pytest.approx(skm.accuracy_score(truth, decided))
    assert history[-1]["val_accuracy"] > 0.8
    # One label per sample given as (N,): counted the same way.
    flat = glassloop.evaluate(nn.Sequential(model, nn.Flatten(0)), [(x, y[:, 0])], nn.BCELoss())
    assert flat["accuracy"] == pytest.approx(skm.accuracy_score(truth, decided))


def test_one_output_column_is_never_put_through_a_softmax(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(8, 3)
    with pytest.warns(UserWarning, match="returns one column and its task is 'auto'"):
        out = glassloop.predict(model, x)
    assert torch.allclose(out, model(x).detach())  # was 1.0 everywhere
    with pytest.raises(glassloop.ModelError, match="needs one output per class"):
        glassloop.predict(model, x, task="classification")
    # An argmax over one column is no accuracy: "auto" with integer labels reports none.
    result = glassloop.evaluate(
        model, [(x, torch.zeros(8, dtype=torch.long))], lambda o, t: o.sum()
    )
    assert "accuracy" not in result
    # A model loaded from a regression run's weights predicts values, as its file says.
    from cli_runner import run_glassloop

    rows = ["a,b,target"] + [f"{i % 7},{i % 3},{(i % 7) * 2.5 - i % 3}" for i in range(60)]
    (tmp_path / "r.csv").write_text("\n".join(rows) + "\n")
    done = run_glassloop(
        "train", "--run-dir", str(tmp_path / "run"), "--set", "data.name=csv",
        "--set", f"data.path={tmp_path / 'r.csv'}", "--set", "data.label_column=target",
        "--set", "loss.name=mse", "--set", "train.epochs=1", "--set", "train.progress=none",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = glassloop.load_model(tmp_path / "run")
    inputs = torch.randn(5, 2)
    assert torch.equal(glassloop.predict(loaded, inputs), loaded(inputs).detach())


def test_named_classification_metrics_equal_sklearn() -> None:
    g = torch.Generator().manual_seed(2)
    logits, labels = torch.randn(200, 5, generator=g), torch.randint(0, 5, (200,), generator=g)
    result = glassloop.evaluate(
        nn.Identity(), [(logits[:120], labels[:120]), (logits[120:], labels[120:])],
        nn.CrossEntropyLoss(),
        metrics=["top2_accuracy", "f1_macro", "balanced_accuracy", "accuracy"],  # (reported anyway)
    )  # fmt: skip
    top2 = (logits.topk(2, dim=1).indices == labels[:, None]).any(1).float().mean()
    predicted = logits.argmax(1).numpy()
    assert result["top2_accuracy"] == pytest.approx(float(top2))
    assert result["f1_macro"] == pytest.approx(skm.f1_score(labels, predicted, average="macro"))
    assert result["balanced_accuracy"] == pytest.approx(
        skm.balanced_accuracy_score(labels, predicted)
    )
    assert result["accuracy"] == pytest.approx(skm.accuracy_score(labels, predicted))


def test_unknown_metric_name_is_refused_before_training() -> None:
    with pytest.raises(glassloop.ConfigError, match="no metric 'r2' for a classification task"):
        trainer_for(nn.Linear(2, 2), nn.CrossEntropyLoss(), metrics=["r2"])
    # What a task reports anyway is a name it knows (a Keras user's metrics=["accuracy"]).
    trainer_for(nn.Linear(2, 1), nn.MSELoss(), metrics=["r2", "mae"])
    glassloop.load_config(None, ["train.metrics=['accuracy']"])
    from glassloop.evaluation.metric_names import make_metric

    with pytest.raises(glassloop.ConfigError, match="no metric"):
        make_metric("auroc", "regression", 1)


# ------------------------------------------------------------------------- language model
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 12, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)  # (N, T, vocab)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def lm_corpus(n: int = 64, length: int = 10, vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences mod vocab: each next token is predictable from the last."""
    start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
    seq = (start + torch.arange(length + 1)) % vocab
    target = seq[:, 1:].clone()
    target[:, -2:][: n // 2] = -100  # padding on half the rows: ignored
    return seq[:, :-1], target


def test_language_model_perplexity_and_token_accuracy_ignore_padding() -> None:
    torch.manual_seed(0)
    x, y = lm_corpus()
    trainer = trainer_for(TinyLM(), lm_loss, task="language-model")
    trainer.optimizer = torch.optim.Adam(trainer.model.parameters(), lr=0.02)
    history = trainer.fit(
        make_loader((x, y), batch_size=16), make_loader((x, y), batch_size=16), epochs=6
    )
    row = history[-1]
    assert row["val_perplexity"] == pytest.approx(math.exp(row["val_loss"]))
    with torch.no_grad():
        logits = trainer.model(x)
    kept = y != -100
    token_accuracy = (logits.argmax(-1)[kept] == y[kept]).float().mean()
    assert row["val_accuracy"] == pytest.approx(float(token_accuracy))
    expected_loss = F.cross_entropy(logits.reshape(-1, 12), y.reshape(-1))  # mean over kept
    assert row["val_loss"] == pytest.approx(float(expected_loss), rel=1e-5)
    assert row["val_accuracy"] > 0.9
    probs = trainer.predict(x[:2])
    assert probs.shape == (2, 10, 12) and torch.allclose(probs.sum(-1), torch.ones(2, 10))


def test_a_large_vocabulary_keeps_no_confusion_matrix() -> None:
    logits, labels = torch.randn(8, 5000), torch.randint(0, 5000, (8,))
    result = glassloop.evaluate(nn.Identity(), [(logits, labels)], nn.CrossEntropyLoss())
    assert "confusion" not in result
    assert result["accuracy"] == pytest.approx(float((logits.argmax(1) == labels).float().mean()))


# --------------------------------------------------------------- outputs and own losses
class ModelOutput(OrderedDict):  # type: ignore[type-arg]
    """What transformers' ModelOutput is: an ordered dict whose keys are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err


class HFStyleClassifier(nn.Module):
    """Like a Hugging Face model: keyword inputs, computes its loss when given labels."""

    def __init__(self, return_dict: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.return_dict = return_dict

    def forward(self, input_values: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.net(input_values)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        if not self.return_dict:
            return (loss, logits) if loss is not None else (logits,)
        out = ModelOutput()
        if loss is not None:
            out["loss"] = loss
        out["logits"] = logits
        return out


def dict_batches(n: int = 96) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return [{"input_values": x[i : i + 16], "labels": y[i : i + 16]} for i in range(0, n, 16)]


@pytest.mark.parametrize("return_dict", [True, False])
def test_a_model_that_computes_its_own_loss_trains_like_the_hand_loop(return_dict: bool) -> None:
    batches = dict_batches()
    torch.manual_seed(0)
    ours = HFStyleClassifier(return_dict)
    hand = HFStyleClassifier(return_dict)
    hand.load_state_dict(ours.state_dict())
    trainer = trainer_for(ours, None, task="classification")
    history = trainer.fit(batches, batches, epochs=2)
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.05)
    for _ in range(2):
        for batch in batches:
            out = hand(**batch)
            loss = out["loss"] if return_dict else out[0]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(ours.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "val_accuracy" in history[-1] and "val_confusion" not in history[-1]
    probs = trainer.predict([{"input_values": b["input_values"]} for b in batches])
    assert probs.shape == (96, 3) and torch.allclose(probs.sum(1), torch.ones(96))


@pytest.mark.parametrize("kind", ["dict", "tuple", "modeloutput"])
def test_evaluate_and_predict_find_the_prediction_in_structured_outputs(kind: str) -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> Any:
            logits = self.linear(x)
            if kind == "dict":
                return {"logits": logits, "features": x}
            if kind == "tuple":
                return logits, x
            return ModelOutput(logits=logits)

    model = Net()
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output[0] if kind == "tuple" else output["logits"]
        return F.cross_entropy(logits, target)

    trainer = trainer_for(model, loss_fn)
    trainer.fit([(x, y)], [(x, y)], epochs=1)
    result = trainer.evaluate([(x, y)])
    assert result["accuracy"] == pytest.approx(
        float((model.linear(x).argmax(1) == y).float().mean())
    )
    assert torch.allclose(trainer.predict(x), torch.softmax(model.linear(x), 1).detach())


def test_predict_with_several_inputs_keeps_them_all() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.linear(a + b)

    model = TwoInputs()
    a, b, y = torch.randn(5, 3), torch.randn(5, 3), torch.randint(0, 2, (5,))
    expected = torch.softmax(model(a, b), 1).detach()
    assert torch.allclose(glassloop.predict(model, [(a, b)]), expected)
    assert torch.allclose(glassloop.predict(model, [(a, b, y)]), expected)  # target dropped


# ------------------------------------------------------------- metrics, hooks, extension
class HeadMetrics(Callback):
    def on_validation_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        metrics["head_gap"] = 0.5 * metrics["loss"]

    def on_epoch_end(self, trainer: Trainer, row: dict[str, Any]) -> None:
        row["custom_score"] = float(row["epoch"]) * 10


def test_metrics_from_callbacks_reach_history_csv_jsonl_and_monitor(tmp_path: Path) -> None:
    x, y = regression_data()
    trainer = trainer_for(
        nn.Linear(5, 1), nn.MSELoss(), run_dir=tmp_path, callbacks=[HeadMetrics()],
        checkpoint=glassloop.options.CheckpointConfig(monitor="val_r2"),
    )  # fmt: skip
    trainer.fit(make_loader((x, y), batch_size=64), make_loader((x, y), batch_size=64), epochs=2)
    row = trainer.history[-1]
    assert row["val_head_gap"] == pytest.approx(0.5 * row["val_loss"])
    assert row["custom_score"] == 20.0
    with (tmp_path / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r["kind"] == "epoch"]
    assert [float(r["custom_score"]) for r in rows] == [10.0, 20.0]
    assert float(rows[-1]["val_r2"]) == pytest.approx(row["val_r2"])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["val_head_gap"] == pytest.approx(row["val_head_gap"])
    # r2 is maximised: best/ holds the epoch with the highest val_r2
    best = json.loads((tmp_path / "best" / "meta.json").read_text())
    assert best["metrics"]["val_r2"] == max(r["val_r2"] for r in trainer.history)


class Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.validations = 0

    def on_step_end(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None:
        self.steps.append(step)
        self.losses.append(loss)

    def on_validation_start(self, trainer: Trainer) -> None:
        self.validations += 1


def test_step_hooks_and_validation_every_n_steps(tmp_path: Path) -> None:
    x, y = regression_data(128)
    watcher = Steps()
    trainer = trainer_for(
        nn.Linear(5, 1), nn.MSELoss(), callbacks=[watcher], validate_every_n_steps=3,
        run_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(make_loader((x, y), batch_size=16), make_loader((x, y), batch_size=64), epochs=2)
    assert watcher.steps == list(range(1, 17))
    assert all(loss.ndim == 0 and not loss.requires_grad for loss in watcher.losses)
    # steps 3, 6, ..., 15 plus the two epoch ends
    assert watcher.validations == 5 + 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [3, 6, 9, 12, 15]
    assert all("val_r2" in r for r in rows if r["kind"] == "val")


def test_lr_find_in_python_leaves_the_trainer_untouched(tmp_path: Path) -> None:
    x, y = regression_data()
    model = nn.Linear(5, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = trainer_for(model, nn.MSELoss())
    found = glassloop.lr_find(trainer, make_loader((x, y), batch_size=32), steps=60)
    assert 1e-7 <= found.suggestion <= 10
    assert len(found.lrs) == len(found.losses) > 10
    assert found.plot(tmp_path / "lr.png").stat().st_size > 1000
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert trainer.optimizer.param_groups[0]["lr"] == 0.05


def test_make_loader_on_an_iterable_dataset_is_a_clear_error() -> None:
    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            yield from range(3)

    with pytest.raises(DataError, match="Stream has no length"):
        make_loader(Stream(), batch_size=2)


def test_a_real_hugging_face_model_trains_with_its_own_loss_bitwise() -> None:
    transformers = pytest.importorskip("transformers")  # a dev dependency; never downloads
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=2, max_position_embeddings=16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (192, 12), generator=g)
    labels = (ids[:, 0] > 25).long()
    batches = [
        {"input_ids": ids[i : i + 32], "labels": labels[i : i + 32]} for i in range(0, 192, 32)
    ]
    torch.manual_seed(0)
    ours = transformers.BertForSequenceClassification(config)
    hand = copy.deepcopy(ours)
    torch.manual_seed(1)  # dropout masks
    optimizer = torch.optim.AdamW(hand.parameters(), lr=3e-3)
    hand.train()
    for _ in range(3):
        for batch in batches[:4]:
            hand(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        hand.eval()  # glassloop validates each epoch (no RNG drawn from a list of batches)
        hand.train()
    torch.manual_seed(1)
    trainer = Trainer(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3), None,
                      task="classification", device="cpu", progress="none")  # fmt: skip
    history = trainer.fit(batches[:4], batches[4:], epochs=3)
    for a, b in zip(ours.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    assert history[-1]["val_accuracy"] > 0.8
    probs = trainer.predict([{"input_ids": ids[:3]}])
    with torch.no_grad():
        expected = torch.softmax(ours.eval()(input_ids=ids[:3]).logits, -1)
    assert torch.allclose(probs, expected, atol=1e-6)


def test_a_tokenizers_padded_batches_train_and_predict_as_they_come() -> None:
    """DataCollatorWithPadding (and tokenizer.pad) returns a BatchEncoding, a Mapping but no
    dict: fit and predict refused it ("a training batch must be a tuple/list ... or a dict").
    Fed as it comes, with no glue, the weights equal a hand loop's over the same loader."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models
    from torch.utils.data import DataLoader

    words = {"[PAD]": 0, **{f"w{i}": i for i in range(1, 50)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="[PAD]")), pad_token="[PAD]"
    )
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(64):
        ids = torch.randint(1, 50, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
        samples.append({"input_ids": ids.tolist(), "labels": int(ids[0] > 25)})
    loader = DataLoader(
        samples, batch_size=16, collate_fn=transformers.DataCollatorWithPadding(tokenizer)
    )
    assert isinstance(next(iter(loader)), transformers.BatchEncoding)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    ours = transformers.BertForSequenceClassification(config)
    hand = copy.deepcopy(ours)
    torch.manual_seed(1)  # dropout masks
    optimizer = torch.optim.AdamW(hand.parameters(), lr=3e-3)
    hand.train()
    for batch in loader:
        hand(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(1)
    trainer = Trainer(
        ours,
        torch.optim.AdamW(ours.parameters(), lr=3e-3),
        None,
        task="classification",
        device="cpu",
        progress="none",
    )
    trainer.fit(loader, epochs=1)
    for a, b in zip(ours.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    batch = tokenizer.pad([{"input_ids": [3, 4, 5]}, {"input_ids": [30]}], return_tensors="pt")
    with torch.no_grad():
        expected = torch.softmax(ours.eval()(**batch).logits, -1)
    assert torch.allclose(trainer.predict([batch]), expected, atol=1e-6)


def test_a_causal_lm_that_shifts_its_labels_gets_its_token_accuracy_shifted_too() -> None:
    """A Hugging Face causal LM given labels= shifts them inside (position t predicts token
    t+1). Compared unshifted, val_accuracy stayed 0.3853 for three epochs while the loss
    fell; now it is counted as the model's own loss counts tokens."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 10, (96, 1), generator=g)
    ids = (start + torch.arange(12)) % 40  # a counting sequence: learnable next tokens
    ids[80:, 9:] = -100  # some padding in the labels of the validation batches
    labels = ids.clone()
    ids = ids.clamp(min=0)
    batches = [
        {"input_ids": ids[i : i + 16], "labels": labels[i : i + 16]} for i in range(0, 96, 16)
    ]
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), None,
                      task="language-model", device="cpu", progress="none")  # fmt: skip
    history = trainer.fit(batches[:4], batches[4:], epochs=3)
    model.eval()
    with torch.no_grad():
        correct = counted = 0
        loss_sum = 0.0
        for batch in batches[4:]:
            out = model(**batch)
            logits, target = out.logits[:, :-1], batch["labels"][:, 1:]
            kept = target != -100
            correct += int((logits.argmax(-1)[kept] == target[kept]).sum())
            counted += int(kept.sum())
            loss_sum += float(out.loss) * int(kept.sum())
    row = history[-1]
    assert row["val_accuracy"] == pytest.approx(correct / counted)
    assert row["val_loss"] == pytest.approx(loss_sum / counted, rel=1e-6)
    assert row["val_perplexity"] == pytest.approx(math.exp(loss_sum / counted), rel=1e-6)
    accuracies = [r["val_accuracy"] for r in history]
    assert accuracies[-1] > accuracies[0]  # it moves with the loss


class SumVAE(nn.Module):
    """pytorch/examples' VAE shape in small: reconstruction + KL, summed over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 4), nn.Linear(2, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.dec(z)), mu, logvar


def vae_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    recon, mu, logvar = output
    bce = F.binary_cross_entropy(recon, target, reduction="sum")
    return bce - 0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())


@pytest.mark.parametrize("accum", [1, 2])
def test_a_loss_that_sums_over_its_batch_is_reported_per_sample(accum: int) -> None:
    """The VAE's train_loss was 38,698 where the example reports 303.7 per sample: a number
    that scales with the batch size. With loss_reduction="sum" losses are per sample, and
    accumulated micro-batches add up as the sums they are (bitwise the hand loop's)."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(96, 6, generator=g)
    batches = [(x[i : i + 16], x[i : i + 16]) for i in range(0, 96, 16)]
    torch.manual_seed(0)
    model = SumVAE()
    hand = copy.deepcopy(model)
    optimizer = torch.optim.Adam(hand.parameters(), lr=1e-2)
    torch.manual_seed(1)
    sums = []
    for i in range(0, len(batches), accum):
        for bx, by in batches[i : i + accum]:
            loss = vae_loss(hand(bx), by)
            loss.backward()  # micro-batch sums add up to the window's sum
            sums.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), vae_loss,
                      loss_reduction="sum", grad_accum_steps=accum, device="cpu", progress="none")  # fmt: skip
    torch.manual_seed(1)
    history = trainer.fit(batches, epochs=1)
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    assert history[0]["train_loss"] == pytest.approx(sum(sums) / 96, rel=1e-6)
    assert 2 < history[0]["train_loss"] < 10  # per sample, not per batch of 16
    torch.manual_seed(2)  # (the VAE samples in eval mode too: the same draws both ways)
    result = trainer.evaluate(batches)
    torch.manual_seed(2)
    with torch.no_grad():
        expected = sum(float(vae_loss(model.eval()(bx), by)) for bx, by in batches) / 96
    assert result["loss"] == pytest.approx(expected, rel=1e-6)
    # A module that carries reduction="sum" says so itself.
    assert Trainer(nn.Linear(2, 2), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1),
                   nn.MSELoss(reduction="sum"), device="cpu").loss_reduction == "sum"  # fmt: skip


@pytest.mark.parametrize(
    ("task", "loss_fn", "implied"),
    [
        ("regression", nn.CrossEntropyLoss(), "classification"),
        ("multilabel", F.mse_loss, "regression"),
        ("classification", nn.BCEWithLogitsLoss(), "multilabel"),
    ],
)
def test_a_task_that_does_not_fit_its_loss_is_one_line(
    task: str, loss_fn: Any, implied: str
) -> None:
    """Trainer(task="regression", loss_fn=nn.CrossEntropyLoss()) trained a cross-entropy over
    one column (0.0 at every step) and reported a regression's metrics: refused, naming both;
    a language model's per-token cross-entropy and "custom" take their losses."""
    model = nn.Linear(3, 2)
    with pytest.raises(
        ConfigError, match=f"task '{task}' does not fit the loss .*, a {implied} loss"
    ):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, task=task)
    for fitting in ("language-model", "custom"):
        Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), task=fitting
        )
