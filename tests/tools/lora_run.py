"""A LoRA fine-tuning of a tiny LLaMA-style model built from a config (no download), as a user
writes it; tests/tools/test_fine_tuning.py runs it in fresh processes.

    python lora_run.py train RUN [--kill-at N]   # N: SIGKILL itself in training forward N
    python lora_run.py resume RUN [--wrong-base] # --wrong-base: first try another base
    python lora_run.py load LOGITS FOLDER:KIND...  # KIND: adapter | model; max |diff| each

``train`` (without a kill) also trains ``full`` (the base alone, no adapter) and writes, next
to RUN, what the trained models compute (``RUN-logits.safetensors``: the adapter's, the merged
model's, the full run's) and the Python exports (``RUN-adapter``, ``RUN-merged``).
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

import glassloop

CONFIG = transformers.LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def base(seed: int = 0) -> transformers.LlamaForCausalLM:
    """The pretrained model, as from_pretrained would give it: the same weights every time."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(CONFIG)


def lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.1, task_type="CAUSAL_LM")  # fmt: skip
    return peft.get_peft_model(model, config)


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 100, (96, 1), generator=g)
    ids = (start + torch.arange(16)) % 128  # counting sequences: something to learn
    return [{"input_ids": ids[i : i + 8], "labels": ids[i : i + 8]} for i in range(0, 96, 8)]


def trainer(model: torch.nn.Module, run: str) -> glassloop.Trainer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return glassloop.Trainer(
        model, torch.optim.AdamW(trainable, lr=3e-3), None, task="language-model",
        device="cpu", progress="none", seed=1, run_dir=run,
        checkpoint=glassloop.CheckpointConfig(every_n_steps=3),
    )  # fmt: skip


def fit(model: torch.nn.Module, run: str, resume: str | None = None) -> glassloop.Trainer:
    data = batches()
    fitted = trainer(model, run)
    fitted.fit(data[:10], data[10:], epochs=2, resume=resume)
    return fitted


def kill_at(model: torch.nn.Module, n: int) -> None:
    calls = [0]

    def count(module: torch.nn.Module, args: object) -> None:
        if module.training:
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(count)


def probe() -> torch.Tensor:
    return batches()[-1]["input_ids"]


def main() -> None:
    command, where = sys.argv[1], sys.argv[2]
    if command == "train":
        model = lora(base())
        if "--kill-at" in sys.argv:
            kill_at(model, int(sys.argv[sys.argv.index("--kill-at") + 1]))
        fit(model, where)
        glassloop.export_hf(model, f"{where}-adapter")
        glassloop.export_hf(model, f"{where}-merged", merged=True)
        model.eval()
        with torch.no_grad():
            adapter = model(probe()).logits
            merged = model.merge_and_unload()  # (after the exports: it changes the model)
            outputs = {"adapter": adapter, "model": merged(probe()).logits}
        if "--kill-at" not in sys.argv:  # the same model without an adapter, as well
            full = base()
            fit(full, "full")
            with torch.no_grad():
                outputs["full"] = full.eval()(probe()).logits
        save_file({k: v.contiguous() for k, v in outputs.items()}, f"{where}-logits.safetensors")
    elif command == "resume":
        if "--wrong-base" in sys.argv:
            try:
                fit(lora(base(seed=7)), where, resume="auto")
            except glassloop.CheckpointError as err:
                print(f"refused: {err}")
        fit(lora(base()), where, resume="auto")
    elif command == "load":
        expected = load_file(where)
        for folder, kind in (pair.split(":") for pair in sys.argv[3:]):
            if kind == "adapter":
                import peft

                loaded = peft.PeftModel.from_pretrained(base(), folder)
            else:
                loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
            with torch.no_grad():
                logits = loaded.eval()(probe()).logits
            name = "full" if folder.startswith("full") else kind
            print(f"{folder}: max |diff| = {float((logits - expected[name]).abs().max())}")


if __name__ == "__main__":
    main()
