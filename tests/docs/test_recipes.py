"""Every recipe in recipes/ runs end to end, offline: on the bundled MNIST subset (image
recipes) or a generated corpus (text), for one epoch. The full results are in
docs/recipes.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_glassloop
from corpora import reviews

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def generated_corpus(path: Path) -> None:
    lines = ["text,label", *(f"{text},{label}" for text, label in reviews(300))]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.toml")))
def test_recipe_smoke(recipe: str, tmp_path: Path) -> None:
    overrides = ["--set", "train.epochs=1", "--set", "train.progress=none"]
    if recipe.startswith("text"):
        generated_corpus(tmp_path / "texts.csv")
        overrides += ["--set", f"data.path={tmp_path / 'texts.csv'}"]
    else:
        overrides += ["--set", "data.name=mnist-5k"]  # the bundled subset: no download
    result = run_glassloop(
        "train", str(RECIPES / recipe), *overrides, "--run-dir", str(tmp_path / "run")
    )
    assert result.returncode == 0, result.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    epoch = [row for row in rows if row["kind"] == "epoch"][-1]
    assert epoch["val_accuracy"] > 0.1  # above chance: it trained
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_every_recipe_states_its_source_and_expectation() -> None:
    for recipe in RECIPES.glob("*.toml"):
        header = recipe.read_text().split("\n[")[0]
        assert (
            "Expected" in header
            or "No reference number" in header
            or "reference text gives no number" in header
        ), recipe.name
