"""Text classification end to end on a corpus the test generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from corpora import reviews

from glassloop import DataError, build, load_config


def corpus(path: Path, n: int = 400, jsonl: bool = False) -> None:
    rows = [{"review": text, "sentiment": label} for text, label in reviews(n)]
    if jsonl:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(
            "review,sentiment\n" + "".join(f"{r['review']},{r['sentiment']}\n" for r in rows)
        )


@pytest.mark.parametrize(("encoder", "jsonl"), [("gru", False), ("transformer", True)])
def test_text_pipeline_trains_above_chance(tmp_path: Path, encoder: str, jsonl: bool) -> None:
    path = tmp_path / ("reviews.jsonl" if jsonl else "reviews.csv")
    corpus(path, jsonl=jsonl)
    cfg = load_config(None, [
        "data.name=text-csv", f"data.path={path}", "data.text_column=review",
        "data.label_column=sentiment", "data.vocab_size=200", "data.batch_size=16",
        "model.name=text-classifier", f"model.encoder={encoder}", "model.embed_dim=32",
        "optim.lr=3e-3", "train.epochs=6", "train.progress=none",
    ])  # fmt: skip
    run = build(cfg, run_dir=tmp_path / "run")
    assert run.splits.class_names == ["neg", "pos"]
    first = next(iter(run.train_loader))
    assert set(first) == {"input_ids", "attention_mask", "lengths", "labels"}
    assert first["attention_mask"].sum(1).tolist() == first["lengths"].tolist()
    history = run.trainer.fit(run.train_loader, run.val_loader, epochs=6)
    assert history[-1]["val_accuracy"] >= 0.8  # chance is 0.5
    from glassloop import load_model

    model = load_model(tmp_path / "run" / "model.safetensors")  # rebuilt with its vocabulary
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in run.trainer.model.parameters()
    )


def test_text_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    corpus(path, n=20)
    cfg = load_config(None, ["data.name=text-csv", f"data.path={path}"])
    with pytest.raises(DataError, match=r"has no column 'text'; it has review, sentiment"):
        build(cfg)
