"""The Trainer's arguments, one line each, grouped as its signature groups them.

The table is what ``help(Trainer)`` shows under "Arguments" (appended to the class docstring
by :func:`described`), so that loop.py reads as the loop; ``tests/unit/test_trainer_arguments
.py`` fails when an argument has no line here. A config sets each one of the same name under
``[train]`` (the CLI's ``--set train.NAME=...``).
"""

from __future__ import annotations

import textwrap

ARGUMENTS: dict[str, dict[str, str]] = {
    "the model, its loss and what it is for": {
        "model": "any ``nn.Module``; its outputs (a tensor, a tuple, a dict, a Hugging Face "
        "output) go to ``loss_fn``.",
        "optimizer": "a ``torch.optim`` optimizer, or several by name (``{'g': ..., 'd': ...}``, "
        "a GAN's: :class:`~glassloop.optimizers.Optimizers`, stepped in turn by the default "
        "step, one by one with ``step()`` in an overridden ``train_step``); one whose ``step`` "
        "takes a closure (LBFGS) gets one.",
        "loss_fn": "``loss_fn(output, target)``; ``None``: the model's own (it gets the target "
        "as ``labels=``, as Hugging Face models do).",
        "task": '"auto" (from the loss), "classification", "multilabel", "regression", '
        '"language-model" or "custom": what ``predict`` returns and which metrics are '
        "reported (:mod:`glassloop.tasks`); a model with several heads: a task each "
        "(``{'kind': 'classification', 'size': 'regression'}``: every head predicted, its "
        "metrics as ``val_<head>_<metric>``).",
        "outputs": '"auto", "logits" or "probabilities": what the model returns; probabilities '
        "(auto: with BCELoss or a final ``nn.Sigmoid``/``nn.Softmax``) are never put through a "
        "second sigmoid or softmax by ``predict``, and a label is decided at 0.5.",
        "metrics": "more metrics, by name (``['top5_accuracy']``) or ``{name: metric}``.",
    },
    "the step": {
        "precision": '"32", "bf16" or "fp16" (with a GradScaler).',
        "grad_accum_steps": "micro-batches per optimizer step, weighted by ``loss_weighting`` "
        "so that a step is one big batch.",
        "loss_weighting": '"samples", or "tokens" (labels other than ``ignore_index``).',
        "loss_reduction": '"auto" (the loss module\'s), "mean" or "sum" (reported per sample).',
        "ignore_index": "the label a token loss skips (-100, as ``CrossEntropyLoss``).",
        "clip_grad_norm": "clip the gradients' total norm to this; the norm before clipping is "
        "reported as ``grad_norm``.",
        "clip_grad_value": "clip each gradient element to ``[-value, value]``.",
        "nonfinite": 'on a NaN/inf loss or gradient: "raise" (seen on the device, read where '
        "the loop reads anyway, stops naming the first bad step, nothing saved after it), "
        '"strict" (checked before every step), "skip" (dropped), or a '
        ":class:`~glassloop.guards.NonFinitePolicy` (``max_skips`` in a row).",
        "loss_spike": "also stop at a finite loss over this many times the median of the 20 "
        "steps before, naming its step and batches (0: off).",
        "ema_decay": "a moving average of the weights, evaluated and exported instead.",
        "compile": "``True``, or ``torch.compile``'s ``{'mode': ..., 'dynamic': ...}``.",
        "activation_checkpointing": "module class names whose activations are recomputed in "
        "backward instead of kept: less memory, bitwise the same weights "
        "(:func:`~glassloop.parallelize.checkpoint_activations`).",
        "scheduler": "an LR scheduler (or several by name); ``ReduceLROnPlateau`` steps on "
        "val_loss.",
        "scheduler_interval": 'the scheduler steps every "epoch" or every "step".',
    },
    "the epoch": {
        "validate_every_n_steps": 'also validate inside epochs (``"kind": "val"`` rows).',
        "limit_batches": "at most this many batches per epoch (a quick run through everything).",
        "seed": "seeds python/numpy/torch here, after the model was built (call "
        ":func:`glassloop.seed_everything` before building it for reproducible initial "
        "weights).",
        "deterministic": "``True``: torch's deterministic algorithms (and cuDNN's, cuBLAS's "
        'workspace); ``"warn"``: only warn where an operation has none (process-wide; '
        "recorded in run.json).",
        "callbacks": "hooks around the loop (:mod:`glassloop.callbacks`).",
    },
    "where it runs": {
        "device": '"auto" (CUDA, MPS, CPU) or a device.',
        "world": "the job's processes (default: torchrun's environment).",
        "strategy": '"auto"/"ddp", or "fsdp" (FSDP2).',
    },
    "the run directory": {
        "run_dir": "where checkpoints, metrics and the report go (``None``: nothing written).",
        "checkpoint": "when to save, how many to keep, what picks ``best/`` "
        "(:class:`~glassloop.checkpointer.CheckpointConfig`).",
        "run_info": "the config a resume compares and the model spec that rebuilds the model "
        "from its weights (:class:`~glassloop.run_log.RunInfo`).",
        "tensorboard": "also write TensorBoard event files.",
        "tracking": "MLflow or W&B (:class:`~glassloop.tracking.TrackingConfig`).",
        "progress": '"auto", "bar", "lines" or "none".',
        "log_every": "a step row (and the tutorial's loss line) every this many steps.",
        "profile": "a ``torch.profiler`` trace of this many steps into ``RUN_DIR/profile/``, "
        "and the top operators printed (:mod:`glassloop.profiling`).",
    },
}

REPLACED = "max_nonfinite_skips, compile_mode, compile_dynamic, config, model_spec"


def described() -> str:
    """The "Arguments" section of the Trainer's docstring, from :data:`ARGUMENTS`."""
    lines = ["", "    Arguments (keywords after the first three), by concern:", ""]
    for concern, arguments in ARGUMENTS.items():
        lines.append(f"    {concern.capitalize()}:")
        for name, text in arguments.items():
            lines.append(textwrap.fill(f"``{name}``: {text}", 92, initial_indent=" " * 6,
                                       subsequent_indent=" " * 8))  # fmt: skip
        lines.append("")
    replaced = f"Replaced in 0.2, accepted with a warning until 0.3: {REPLACED}."
    lines.append(textwrap.fill(replaced, 92, initial_indent=" " * 4, subsequent_indent=" " * 4))
    return "\n".join(lines) + "\n"
