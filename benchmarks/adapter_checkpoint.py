"""A LoRA checkpoint against the full fine-tuning checkpoint of the same model (issue 36).

A LLaMA-style model built from a config (no download: hidden 512, 8 layers, vocabulary
32,000; 59 M parameters) is fine-tuned two ways, AdamW, one process, CPU:

* ``full``: every parameter trains; a checkpoint holds the weights and AdamW's two moments;
* ``lora``: peft LoRA r=8 on q_proj and v_proj; a checkpoint holds the adapter, its optimizer
  state and the SHA-256 of the frozen base (computed once, at the first save).

Each run takes ``--steps`` steps with a checkpoint after every step; reported: the bytes of one
checkpoint folder and the median seconds of a save (what the step waits for; from run.json),
and the first save's (the lora run's includes hashing the base). The two runs alternate,
``--repeats`` times. Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/adapter_checkpoint.py``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import peft
import torch
import transformers

import glassloop

CONFIG = transformers.LlamaConfig(
    vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
)  # fmt: skip


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(CONFIG)
    if kind == "full":
        return base
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")  # fmt: skip
    return peft.get_peft_model(base, lora)


def run(kind: str, steps: int, root: Path) -> dict[str, float]:
    net = model(kind)
    ids = torch.randint(0, 32000, (steps * 2, 32), generator=torch.Generator().manual_seed(0))
    batches = [
        {"input_ids": ids[i : i + 2], "labels": ids[i : i + 2]} for i in range(0, len(ids), 2)
    ]
    trainable = [p for p in net.parameters() if p.requires_grad]
    run_dir = root / f"{kind}-{time.monotonic_ns()}"
    trainer = glassloop.Trainer(
        net, torch.optim.AdamW(trainable, lr=1e-4), None, task="language-model", device="cpu",
        progress="none", run_dir=run_dir,
        checkpoint=glassloop.CheckpointConfig(every_n_steps=1, keep_last=1, every_n_epochs=0),
    )  # fmt: skip
    trainer.fit(batches, epochs=1)
    times = trainer.checkpointer.times
    folder = max((run_dir / "checkpoints").glob("step-*"))
    size = sum(f.stat().st_size for f in folder.iterdir())
    info = json.loads((run_dir / "run.json").read_text())["checkpoints"]
    return {
        "bytes": size,
        "save_s": info["blocking_s"],
        "first_save_s": times.blocking_s[0],
        "final_bytes": (run_dir / "model.safetensors").stat().st_size,
        "params": sum(p.numel() for p in trainable),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory(dir=".") as root:
        for _ in range(args.repeats):
            for kind in ("full", "lora"):  # interleaved
                found[kind].append(run(kind, args.steps, Path(root)))
    rows = {
        kind: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for kind, rs in found.items()
    }
    full, lora = rows["full"], rows["lora"]
    print(
        "| | trainable parameters | checkpoint | a save (median) | the first save | final weights |"
    )
    print("|---|---|---|---|---|---|")
    for kind, row in rows.items():
        print(f"| {kind} | {row['params']:,.0f} | {row['bytes'] / 1e6:,.2f} MB | "
              f"{row['save_s']:.3f} s | {row['first_save_s']:.3f} s | "
              f"{row['final_bytes'] / 1e6:,.2f} MB |")  # fmt: skip
    print(f"| lora / full | | {lora['bytes'] / full['bytes']:.2%} | "
          f"{lora['save_s'] / full['save_s']:.2%} | | "
          f"{lora['final_bytes'] / full['final_bytes']:.2%} |")  # fmt: skip


if __name__ == "__main__":
    main()
