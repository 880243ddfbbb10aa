"""Hugging Face ``datasets`` as an input: a ``Dataset`` passed to ``fit`` trains in glassloop's
seeded order (a plain module by its argument names, a Hugging Face model with its own loss),
a streaming ``IterableDataset`` resumes after ``kill -9`` in a new process bit for bit (one
that shuffles through a buffer says what its resume skips), and ``data.name = "hf"`` reads
a saved dataset or Parquet/Arrow files as the Parquet reader's rows."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import forkserver
import pytest
import torch
from cli_runner import run_glassloop, sets
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

datasets = pytest.importorskip("datasets")  # the dev extra; nothing is downloaded

import glassloop  # noqa: E402
from glassloop import Trainer  # noqa: E402
from glassloop.data.hf_datasets import StreamedBatches, hf_data, loader_for  # noqa: E402
from glassloop.data.loaders import epoch_seed  # noqa: E402
from glassloop.data.options import DataConfig  # noqa: E402
from glassloop.distributed.world import World  # noqa: E402
from glassloop.errors import DataError  # noqa: E402


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What load_dataset converts goes to this test's folder, not the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


class Net(nn.Module):
    """A plain module whose forward names its input ``x`` (dropout: the global RNG)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class Indexed(Net):
    """One that takes the rows' ids too."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


def rows(n: int = 60) -> tuple[torch.Tensor, torch.Tensor, Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    table = {"x": x.tolist(), "label": y.tolist(), "idx": list(range(n))}
    return x, y, datasets.Dataset.from_dict(table)


def test_a_dataset_trains_in_glassloops_seeded_order_bit_for_bit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """fit(ds, val, batch_size=8): each epoch the seeded permutation of the whole set (what
    make_loader draws from the Trainer's seed), dict rows collated into x and label, the
    column forward does not take ('idx') left out and said once; the weights equal a hand
    loop's, with and without .with_format("torch"); evaluate, predict, doctor and lr_find
    take it too. Before:
    the rows were iterated one by one as batches, and model(x=..., idx=...) a TypeError."""
    x, y, data = rows()
    torch.manual_seed(0)
    start = Net()
    hand = Net()
    hand.load_state_dict(start.state_dict())
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.1)
    torch.manual_seed(1)
    for epoch in range(2):
        order = torch.randperm(60, generator=torch.Generator().manual_seed(epoch_seed(5, epoch)))
        hand.train()
        for idx in order.split(8):
            nn.functional.cross_entropy(hand(x[idx]), y[idx]).backward()
            optimizer.step()
            optimizer.zero_grad()
    for given in data, data.with_format("torch"):
        model = Net()
        model.load_state_dict(start.state_dict())
        torch.manual_seed(1)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          nn.CrossEntropyLoss(), seed=5, device="cpu", progress="none")  # fmt: skip
        torch.manual_seed(1)  # (seed=5 seeded the global RNG too: the hand loop's dropout)
        history = trainer.fit(given, given.select(range(20)), epochs=2, batch_size=8)
        for a, b in zip(model.parameters(), hand.parameters(), strict=True):
            assert torch.equal(a, b)
        said = capsys.readouterr().out
        assert said.count("data: the dataset's column idx is not an argument") == 1, said
        hand.eval()
        with torch.no_grad():
            expected = nn.functional.cross_entropy(hand(x[:20]), y[:20], reduction="sum") / 20
        assert history[-1]["val_loss"] == pytest.approx(float(expected), rel=1e-6)
        again = trainer.evaluate(given.select(range(20)))  # (batches of 64: sums in another order)
        assert again["loss"] == pytest.approx(history[-1]["val_loss"], rel=1e-6)
        with torch.no_grad():
            assert torch.allclose(trainer.predict(given), torch.softmax(hand(x), -1))
    checks = glassloop.doctor(trainer, data, overfit_steps=2, echo=False)  # (its first batch)
    assert [c.status for c in checks][:1] == ["PASS"]
    assert len(glassloop.lr_find(trainer, data, steps=4).lrs) == 4


def test_a_hugging_face_model_trains_on_a_tokenized_dataset_with_its_own_loss() -> None:
    """What a user has after load_dataset and tokenizer.map: a sentence (strings), an id,
    input_ids and attention_mask of several lengths, a label. BertForSequenceClassification
    (built from a config) gets input_ids and attention_mask padded to each batch's longest
    and labels= (its own loss); the sentence and the id are left out. Bit for bit the hand
    loop's over the same order."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=2, max_position_embeddings=16,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 50, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
           for _ in range(48)]  # fmt: skip
    labels = [int(i[0] > 25) for i in ids]
    table = {
        "sentence": [" ".join(f"w{t}" for t in i.tolist()) for i in ids],
        "idx": list(range(48)),
        "input_ids": [i.tolist() for i in ids],
        "attention_mask": [[1] * len(i) for i in ids],
        "label": labels,
    }
    data = datasets.Dataset.from_dict(table)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config)
    hand = transformers.BertForSequenceClassification(config)
    hand.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(hand.parameters(), lr=3e-3)
    torch.manual_seed(1)
    hand.train()
    for epoch in range(2):
        order = torch.randperm(48, generator=torch.Generator().manual_seed(epoch_seed(0, epoch)))
        for idx in order.split(16).__iter__():
            batch = [ids[i] for i in idx.tolist()]
            hand(
                input_ids=pad_sequence(batch, batch_first=True),
                attention_mask=pad_sequence([torch.ones_like(b) for b in batch], batch_first=True),
                labels=torch.tensor([labels[i] for i in idx.tolist()]),
            ).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.manual_seed(1)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), None,
                      task="classification", device="cpu", progress="none")  # fmt: skip
    history = trainer.fit(data, data, epochs=2, batch_size=16)
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    assert 0 <= history[-1]["val_accuracy"] <= 1
    assert trainer.predict(data).shape == (48, 2)


def test_what_a_model_cannot_take_is_refused_in_one_line_saying_what_to_do() -> None:
    """A module whose forward names none of the columns (nn.Sequential's 'input'), a
    DataLoader of dict batches with a key the forward does not take, a batch_size given
    with a loader: each one line saying what to do (was: a bare TypeError)."""
    x, y, data = rows(16)
    model = nn.Sequential(nn.Linear(4, 3))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      device="cpu", progress="none")  # fmt: skip
    with pytest.raises(DataError) as refused:
        trainer.fit(data, epochs=1)
    assert str(refused.value) == (
        "data: none of the dataset's columns (x, label, idx) is an argument of "
        "Sequential.forward(input), which takes a batch's columns by name; rename the input "
        "column to it: ds.rename_column('x', 'input')"
    )
    dicts = DataLoader([{"x": x[i], "label": y[i]} for i in range(16)], batch_size=8)
    with pytest.raises(DataError) as refused:
        trainer.fit(dicts, epochs=1)
    assert str(refused.value) == (
        "data: Sequential.forward() got an unexpected keyword argument 'x': a dict batch's "
        "keys but the target's are the model's keyword arguments; name each input key after "
        "an argument of its forward and drop the others (or make batches (inputs, target) "
        "tuples)"
    )
    with pytest.raises(DataError, match="batch_size is for a Hugging Face dataset; the "
                       "DataLoader given makes its own batches"):  # fmt: skip
        trainer.fit(dicts, epochs=1, batch_size=8)


def test_several_processes_share_a_stream_as_one_process_reads_it() -> None:
    """Two processes with batch 4 each train on the rows one process with batch 8 gets, each
    its half of every global batch (the last, short one split evenly), as make_loader shards
    a map-style set; validation ("strided") gives every row once."""
    _, _, data = rows(21)
    stream = data.to_iterable_dataset(num_shards=3)
    net = Indexed()
    one = [b["idx"].tolist() for b in loader_for(stream, model=net, batch_size=8, shard="batches")]
    two = [
        [b["idx"].tolist() for b in loader_for(stream, model=net, batch_size=4,
                                               world=World(rank, 2), shard="batches")]
        for rank in (0, 1)
    ]  # fmt: skip
    assert [a + b for a, b in zip(*two, strict=True)] == one
    assert [len(b) for b in two[0]] == [4, 4, 3] and [len(b) for b in two[1]] == [4, 4, 2]
    strided = [loader_for(stream, model=net, batch_size=4, world=World(r, 2)) for r in (0, 1)]
    seen = sorted(i for each in strided for b in each for i in b["idx"].tolist())
    assert seen == list(range(21))


SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import datasets, torch
    from torch import nn
    from glassloop import Trainer
    from glassloop.options import CheckpointConfig

    mode, run, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
            self.calls = 0
        def forward(self, x, idx):
            if self.training:
                self.calls += 1
                if self.calls == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                with open(run + ".rows", "a") as rows:
                    rows.write(json.dumps(idx.tolist()) + "\\n")
            return self.net(x)

    g = torch.Generator().manual_seed(0)
    table = {"x": torch.randn(64, 4, generator=g).tolist(), "idx": list(range(64)),
             "label": torch.randint(0, 3, (64,), generator=g).tolist(), "note": ["a"] * 64}
    data = datasets.Dataset.from_dict(table)
    if mode != "map":
        data = data.to_iterable_dataset(num_shards=4)
    if mode == "buffer":
        data = data.shuffle(seed=3, buffer_size=16)
    torch.manual_seed(0)
    model = Net()
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(),
                      seed=1, device="cpu", progress="none", run_dir=run,
                      checkpoint=CheckpointConfig(every_n_steps=1))
    trainer.fit(data, epochs=2, batch_size=8, resume="auto")
    """
)


def test_a_streamed_dataset_resumes_after_kill_9_in_a_new_process_bit_for_bit(
    tmp_path: Path,
) -> None:
    """A Dataset and a stream (to_iterable_dataset, 4 shards), each killed by SIGKILL in the
    middle of step 11 (epoch 2) and resumed by a new process: the rows of every step and the
    final weights are the uninterrupted run's, the stream read on from its own state_dict().
    A stream that shuffles through a buffer (.shuffle(buffer_size=16)) cannot be: Hugging
    Face's state holds no buffer. Its resume says so in one line, and the resumed epoch is
    no permutation of the rows (datasets 5.2: 10 of 64 skipped, 2 read twice)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    def train(mode: str, run: str, kill_at: int = 0) -> Any:
        done = forkserver.run([sys.executable, str(script), mode, str(tmp_path / run),
                               str(kill_at)], cwd=tmp_path, timeout=300)  # fmt: skip
        assert done.returncode == (-9 if kill_at else 0), done.stderr
        return done

    for mode in "map", "stream":
        train(mode, f"{mode}-straight")
        train(mode, f"{mode}-killed", kill_at=11)
        resumed = train(mode, f"{mode}-killed")
        assert "resumed from" in resumed.stdout + resumed.stderr
        assert "warning" not in resumed.stdout + resumed.stderr
        straight = (tmp_path / f"{mode}-straight.rows").read_text().splitlines()
        killed = (tmp_path / f"{mode}-killed.rows").read_text().splitlines()
        assert killed == straight  # (the kill came before step 11 wrote its rows)
        weights = [
            load_file(tmp_path / run / "model.safetensors")
            for run in (mode + "-straight", mode + "-killed")
        ]
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    train("buffer", "buffer", kill_at=11)
    resumed = train("buffer", "buffer")
    said = resumed.stdout + resumed.stderr
    assert (
        "warning: the streamed dataset shuffles through a buffer of 16 rows, which its "
        "state_dict() does not hold: resumed 2 batches into epoch 2, the rest of the epoch is "
        "not the uninterrupted run's (rows the buffer held skipped, others read twice, another "
        "order); exact: a map-style Dataset, which glassloop shuffles whole, or a stream "
        "without a shuffle buffer"
    ) in said, said
    steps = [json.loads(line) for line in (tmp_path / "buffer.rows").read_text().splitlines()]
    epoch_two = [i for step in steps[8:] for i in step]
    assert sorted(epoch_two) != list(range(64))  # (measured: 10 rows skipped, 2 read twice)


def saved_splits(tmp_path: Path) -> Path:
    """A DatasetDict of numeric columns with string labels, train and validation."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g) * 4 + 2

    def split(part: slice) -> Any:
        names = ["cat", "dog"]
        return datasets.Dataset.from_dict({
            "a": x[part, 0].tolist(), "b": x[part, 1].tolist(), "c": x[part, 2].tolist(),
            "label": [names[int(v > 2)] for v in x[part, 0].tolist()],
        })  # fmt: skip

    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": split(slice(0, 40)), "validation": split(slice(40, 50))}
                         ).save_to_disk(str(folder))  # fmt: skip
    return folder


def test_data_name_hf_reads_a_saved_dataset_dict_as_the_parquet_readers_rows(
    tmp_path: Path,
) -> None:
    """A folder save_to_disk wrote (train and validation splits): every numeric column but
    the label, standardised with the training rows' statistics; string labels as sorted class
    indices; the validation split as it is. Parquet files of the same rows, and Arrow files,
    give the same training rows; without a validation split a seeded data.val_fraction."""
    folder = saved_splits(tmp_path)
    data = hf_data(DataConfig(name="hf", path=str(folder)))
    assert (data.class_names, data.input_shape) == (["cat", "dog"], (3,))
    x, y = data.train[3]
    train = datasets.load_from_disk(str(folder))["train"]
    raw = torch.tensor([train[3][c] for c in "abc"])
    mean = torch.tensor([train[c] for c in "abc"]).T.mean(0)
    assert torch.allclose(x, (raw - mean) / torch.tensor(data.preprocessing["std"]), atol=1e-5)
    assert int(y) == ["cat", "dog"].index(train[3]["label"])
    assert len(data.val) == 10 and data.val.labels.tolist() == [
        ["cat", "dog"].index(v) for v in datasets.load_from_disk(str(folder))["validation"]["label"]
    ]
    train.to_parquet(str(tmp_path / "files" / "part-0.parquet"))
    for path in tmp_path / "files", tmp_path / "files" / "*.parquet", folder / "train":
        other = hf_data(DataConfig(name="hf", path=str(path), val_fraction=0.25, seed=2))
        assert len(other.train) == 30 and len(other.val) == 10
        assert other.class_names == ["cat", "dog"]
    first = hf_data(DataConfig(name="hf", path=str(folder / "train"), val_fraction=0.25, seed=2))
    assert torch.equal(first.val.labels, other.val.labels)  # (seeded: the same split)
    batch = next(iter(DataLoader(data.train, batch_size=8)))
    assert batch[0].shape == (8, 3) and batch[1].dtype == torch.int64


def test_data_name_hf_reads_image_and_text_columns(tmp_path: Path) -> None:
    """data.image_column: a Hugging Face Image column (PNG bytes) decoded and standardised
    per channel; data.text_column: strings tokenized (a tokenizer trained on the training
    texts), their ClassLabel's names as the classes."""
    import io

    from PIL import Image

    pngs = []
    for i in range(12):
        buffer = io.BytesIO()
        Image.fromarray(torch.full((6, 6), i * 20, dtype=torch.uint8).numpy()).save(buffer, "PNG")
        pngs.append({"bytes": buffer.getvalue(), "path": None})
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["dark", "light"])}
    )
    images = datasets.Dataset.from_dict(
        {"image": pngs, "label": [int(i >= 6) for i in range(12)]}, features=features
    )
    images.save_to_disk(str(tmp_path / "images"))
    data = hf_data(DataConfig(name="hf", path=str(tmp_path / "images"), image_column="image"))
    assert data.class_names == ["dark", "light"] and data.input_shape == (1, 6, 6)
    x, _ = data.train[0]
    assert x.shape == (1, 6, 6)
    texts = datasets.Dataset.from_dict(
        {"text": ["good film", "bad film", "good plot", "bad plot"] * 5, "label": [1, 0, 1, 0] * 5}
    )
    texts.save_to_disk(str(tmp_path / "texts"))
    data = hf_data(DataConfig(name="hf", path=str(tmp_path / "texts"), vocab_size=50))
    ids, _ = data.train[0]
    assert ids.dtype == torch.long and len(ids) == 2 and data.num_classes == 2


def test_data_name_hf_trains_and_evaluates_from_the_command(tmp_path: Path) -> None:
    """data.name = "hf" in a config: the run trains on the saved dataset and eval, in a new
    process, reads it again the same way."""
    folder, run = saved_splits(tmp_path), tmp_path / "run"
    options = [f"data.path={folder}", "data.name=hf", "train.epochs=8", "optim.lr=0.05",
               "model.hidden=[8]", "train.progress=none", "data.batch_size=8"]  # fmt: skip
    done = run_glassloop("train", "--run-dir", str(run), *sets(options))
    assert done.returncode == 0, done.stderr
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_accuracy"] > 0.8
    evaluated = run_glassloop("eval", str(run))
    assert evaluated.returncode == 0 and "accuracy" in evaluated.stdout, evaluated.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": ""}, "data: data.name = 'hf' needs data.path"),
        ({"path": "nowhere"}, "data: data.path = 'nowhere' is no folder save_to_disk wrote"),
        ({"label_column": "kind"}, "has no column 'kind' in each split (data.label_column, data.image_column, data.text_column); its columns: a, b, c, label"),
    ],
)  # fmt: skip
def test_data_name_hf_refuses_what_it_cannot_read_in_one_line(
    tmp_path: Path, change: dict[str, str], message: str
) -> None:
    options = {"name": "hf", "path": str(saved_splits(tmp_path)), **change}
    with pytest.raises(DataError) as refused:
        hf_data(DataConfig(**options))  # type: ignore[arg-type]
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_stream_validates_on_the_same_rows_each_time() -> None:
    """A stream as a validation set (shuffled through a buffer even) gives the same batches at
    every validation, also after one cut short (limit_batches); before, each read was another
    epoch of its shuffle and a cut one left the next to start where it stopped. Its resume
    caveat is for training: none here."""
    _, _, data = rows(24)
    val = data.to_iterable_dataset(num_shards=2).shuffle(seed=0, buffer_size=8)
    loader = loader_for(val, model=Indexed(), batch_size=4)
    first = [b["idx"].tolist() for b in loader]
    next(iter(loader))  # (a validation of limit_batches=1)
    assert [b["idx"].tolist() for b in loader] == first
    assert isinstance(loader, StreamedBatches) and loader.resume_caveat(0) is None
