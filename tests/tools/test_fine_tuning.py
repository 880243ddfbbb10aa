"""Fine-tuning as people do it (issue 36): LoRA on a tiny LLaMA-style model built from a config,
in fresh processes (tests/tools/lora_run.py). The checkpoints hold the adapter and the
SHA-256 of the base; a kill -9 and a resume on a rebuilt base end bitwise where the straight run
ends, another base is refused in one line; the exports load with transformers and peft
themselves, in a fresh process, and compute bitwise what the trained model computed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from cli_runner import run_glassloop
from safetensors.torch import load_file

import glassloop
from glassloop.step.throughput import TIMING
from glassloop.storage.hugging_face import HF_CONFIG, write_run_hf

pytest.importorskip("peft")
SCRIPT = Path(__file__).with_name("lora_run.py")


def script(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """lora_run.py in a new process (forked: tests/forkserver.py; transformers and peft are
    imported there, by it)."""
    return forkserver.run([sys.executable, str(SCRIPT), *args], cwd=cwd, timeout=300)


def test_lora_checkpoints_resume_bitwise_and_export_to_hugging_face(tmp_path: Path) -> None:
    straight = script("train", "straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr
    cut = script("train", "cut", "--kill-at", "14", cwd=tmp_path)  # in epoch 2, after step 12
    assert cut.returncode == -9, cut.stderr

    # What a checkpoint holds: the adapter and its optimizer state; the base by its digests.
    step = tmp_path / "cut" / "checkpoints" / "step-00000012"
    stored = load_file(step / "model.safetensors")
    assert stored and all(".lora_A." in k or ".lora_B." in k for k in stored), sorted(stored)
    base = json.loads((step / "meta.json").read_text())["base"]
    assert len(base["tensors"]) == 21  # every frozen tensor of the 2-layer model, by name
    full = sum(t.numel() for t in load_file(tmp_path / "straight-merged" / "model.safetensors")
               .values())  # fmt: skip
    assert sum(t.numel() for t in stored.values()) < 0.05 * full

    resumed = script("resume", "cut", "--wrong-base", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert (f"refused: checkpoint: '{Path('cut/checkpoints/step-00000012')}' was trained on "
            "another base: 'base_model.model.model.embed_tokens.weight' differs") \
        in resumed.stdout  # fmt: skip
    a, b = (
        load_file(tmp_path / "straight" / "model.safetensors"),
        load_file(tmp_path / "cut" / "model.safetensors"),
    )
    assert a.keys() == b.keys() == stored.keys()  # the final weights: the adapter alone
    assert all((a[k] == b[k]).all() for k in a)  # bitwise, dropout included
    rows = [(tmp_path / r / "metrics.jsonl").read_text().splitlines() for r in ("straight", "cut")]
    same = [[{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in r]
            for r in rows]  # fmt: skip
    assert same[0] == same[1]

    # The runs exported from their files (CLI) and the model exported in Python: peft loads
    # the adapters onto a fresh base; transformers alone loads the merged model and the run
    # of the model without an adapter (whole, and in shards).
    for run, folder in (("cut", "cli-adapter"), ("full", "full-hf")):
        done = run_glassloop("export", run, "--format", "hf", "--output", folder, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "cli-adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    glassloop.export_run_hf(tmp_path / "full", tmp_path / "full-sharded", max_shard_bytes=100_000)
    shards = sorted(p.name for p in (tmp_path / "full-sharded").glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    folders = ["cli-adapter:adapter", "straight-adapter:adapter", "straight-merged:model",
               "full-hf:model", "full-sharded:model"]  # fmt: skip
    loaded = script("load", "straight-logits.safetensors", *folders, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    for pair in folders:
        assert f"{pair.split(':')[0]}: max |diff| = 0.0\n" in loaded.stdout, loaded.stdout
    for folder in tmp_path.iterdir():  # pickle-free, as everything else
        assert not any(p.suffix in (".bin", ".pt", ".pth", ".pkl") for p in folder.rglob("*"))


def test_an_export_never_writes_into_or_through_what_is_not_its_own(tmp_path: Path) -> None:
    """An existing folder and a link are left as they are; a merge from a run's files (no
    base in them) is one line. (A run of a small model with a recorded config stands in.)"""
    weights = {"w": torch.ones(2)}
    metadata = {HF_CONFIG: "{}"}
    (tmp_path / "taken").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "taken")
    for name in ("taken", "link"):
        with pytest.raises(glassloop.GlassloopError, match="glassloop left it untouched"):
            write_run_hf(weights, metadata, tmp_path / name, tmp_path / "run")
    assert not any((tmp_path / "taken").iterdir())
    with pytest.raises(glassloop.CheckpointError, match="holds no base to merge an adapter"):
        write_run_hf(weights, metadata, tmp_path / "m", tmp_path / "run", merged=True)
    with pytest.raises(glassloop.CheckpointError, match="not trained from a transformers"):
        write_run_hf(weights, {}, tmp_path / "m", tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "taken"]  # no leftovers
    write_run_hf(weights, metadata, tmp_path / "new", tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        "config.json", "model.safetensors"]  # fmt: skip
