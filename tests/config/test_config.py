"""Config parsing: typed keys, overrides, and one-line errors with suggestions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from glassloop import Config, ConfigError, load_config
from glassloop.config.schema import from_dict, to_dict
from glassloop.config.sections import DEFAULT_OPTIM_KWARGS


def test_defaults_are_the_demo_run() -> None:
    cfg = load_config(None)
    assert (cfg.model.name, cfg.model.hidden) == ("mlp", [512, 512])
    assert (cfg.data.name, cfg.data.batch_size) == ("mnist-5k", 64)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.kwargs["weight_decay"]) == ("AdamW", 1e-3, 0.01)
    assert cfg.scheduler.name == "CosineAnnealingLR"
    assert cfg.train.epochs == 10


def test_toml_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[optim]\nname = "SGD"\nlr = 0.1\nmomentum = 0.9\n'
        '[model]\nhidden = [32]\n[scheduler]\nname = "StepLR"\nstep_size = 2\n'
    )
    cfg = load_config(path, ["optim.lr=3e-4", "data.name=digits", "model.hidden=[16, 8]"])
    assert cfg.optim.name == "SGD" and cfg.optim.lr == 3e-4
    assert cfg.optim.kwargs["momentum"] == 0.9
    assert cfg.scheduler.kwargs == {"step_size": 2}
    assert cfg.data.name == "digits"
    assert cfg.model.hidden == [16, 8]


def test_the_default_optimizer_is_recorded_as_torch_declares_it() -> None:
    """The default [optim] and [scheduler] are resolved without torch: to the arguments,
    in the order, that torch's signatures give."""
    from glassloop.config.optimizers import optimizer_kwargs, scheduler_kwargs

    assert list(optimizer_kwargs("AdamW", {}).items()) == list(DEFAULT_OPTIM_KWARGS.items())
    assert scheduler_kwargs("CosineAnnealingLR", {}) == {}
    through_torch = load_config(None, ["optim.eps=1e-8", "scheduler.name=CosineAnnealingLR"])
    assert list(to_dict(load_config(None))["optim"].items()) == list(
        to_dict(through_torch)["optim"].items()
    )


def test_reading_a_config_imports_no_torch() -> None:
    """``glassloop config`` answers at once: torch (~1.7 s to import) is imported only to check
    an optimizer's or a scheduler's arguments."""
    probe = (
        "import sys\n"
        "from glassloop.cli.main import main\n"
        "main(['config'])\n"
        "main(['config', '--set', 'data.name=digits', '--set', 'model.hidden=[8]'])\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert "TORCH False" in done.stderr, done.stderr


def test_resolved_config_round_trips() -> None:
    # (model.kwargs: a model.target's; a built-in model refuses them)
    overrides = ["optim.betas=[0.8, 0.9]", "model.target=pkg.nets:Net", "model.kwargs.width=3"]
    cfg = load_config(None, overrides)
    assert cfg.optim.kwargs["betas"] == (0.8, 0.9)
    assert from_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optim.learning_rate=1"],
            "config: unknown key 'optim.learning_rate' (did you mean 'optim.lr'?)",
        ),
        (
            ["optim.weight_decy=0.1"],
            "config: unknown key 'optim.weight_decy' (did you mean 'optim.weight_decay'?)",
        ),
        (["train.epoch=3"], "config: unknown key 'train.epoch' (did you mean 'train.epochs'?)"),
        (["optimizer.lr=1"], "config: unknown key 'optimizer' (did you mean 'optim'?)"),
        (["train.epochs=abc"], "config: train.epochs must be an integer, got 'abc'"),
        (["optim.lr=fast"], "config: optim.lr must be a number, got 'fast'"),
        (["data.shuffle=1"], "config: data.shuffle must be true or false, got 1"),
        (["train.epochs=0"], "config: train.epochs must be >= 1, got 0"),
        (
            ["optim.name=adamw"],
            "config: optim.name 'adamw' is not a torch.optim optimizer (did you mean 'AdamW'?)",
        ),
        (
            ["scheduler.interval=batch"],
            "config: scheduler.interval must be one of epoch, step; got 'batch'",
        ),
        (
            ["data.name=imagenet"],
            "config: data.name must be one of mnist-5k, digits, synthetic, npz, csv, image-folder, mnist, fashion-mnist, cifar10, text-csv, parquet, hf; got 'imagenet'",
        ),
        (["optim.momentum=0.9"], "config: unknown key 'optim.momentum' (AdamW accepts:"),
        (["epochs=3"], "config: --set expects section.key=value"),
    ],
)
def test_errors_say_what_and_suggest(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config: file '.*nope\.toml' not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = 1")
    with pytest.raises(ConfigError, match=r"is not valid TOML"):
        load_config(bad)


def test_config_is_a_plain_dataclass() -> None:
    assert isinstance(load_config(None), Config)


def test_training_toolkit_keys() -> None:
    cfg = load_config(
        None,
        [
            "train.precision=bf16",
            "train.grad_accum_steps=4",
            "train.loss_weighting=tokens",
            "train.clip_grad_norm=1",
            "scheduler.name=warmup_cosine",
            "scheduler.warmup_steps=100",
            "early_stopping.monitor=val_loss",
        ],
    )
    assert cfg.train.precision == "bf16" and cfg.train.grad_accum_steps == 4
    assert cfg.train.clip_grad_norm == 1.0
    assert cfg.scheduler.interval == "step"  # warmup_cosine is defined in steps
    assert cfg.scheduler.kwargs == {"warmup_steps": 100, "min_lr_ratio": 0.0}
    with pytest.raises(ConfigError, match=r"train\.precision must be one of 32, bf16, fp16"):
        load_config(None, ["train.precision=fp8"])
    with pytest.raises(ConfigError, match=r"did you mean 'scheduler\.warmup_steps'"):
        load_config(None, ["scheduler.name=warmup_cosine", "scheduler.warmup=3"])
    with pytest.raises(ConfigError, match=r"set scheduler\.interval = 'step'"):
        load_config(None, ["scheduler.name=warmup_cosine", "scheduler.interval=epoch"])


def test_no_decay_groups_and_warmup_cosine_are_built() -> None:
    from glassloop import build

    cfg = load_config(
        None,
        [
            "data.name=synthetic",
            "optim.no_decay_bias_norm=true",
            "scheduler.name=warmup_cosine",
            "scheduler.warmup_steps=5",
            "train.grad_accum_steps=2",
            "train.progress=none",
        ],
    )
    run = build(cfg)
    groups = run.trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(
        p.ndim == 1 for p in groups[1]["params"]
    )
    # 1,638 training samples / 64 = 26 batches = 13 windows of 2 per epoch, 10 epochs.
    assert run.trainer.scheduler.lr_lambdas[0].total_steps == 130


def test_relative_paths_in_a_config_file_name_files_next_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "table.csv").write_text("a,label\n1,0\n")
    (project / "net.py").write_text("")
    (project / "exp.toml").write_text(
        '[data]\nname = "csv"\npath = "table.csv"\n[model]\ntarget = "net.py:Net"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "exp.toml")
    assert cfg.data.path == str(project / "table.csv")
    assert cfg.model.target == f"{project / 'net.py'}:Net"
    # --set values are the user's own, from where they typed them
    assert load_config(project / "exp.toml", ["data.path=table.csv"]).data.path == "table.csv"
    monkeypatch.chdir(project)  # the file in the current directory: paths as written
    assert load_config("exp.toml").data.path == "table.csv"


def test_a_resume_sizes_its_loader_from_its_checkpoint_with_a_run_dir_given_as_text(
    tmp_path: Path,
) -> None:
    """``build(run_dir="runs/a", resume=...)`` as the Python API and Ray's config entry pass it
    (a string, not a ``Path``): the loader takes the global batch of the checkpoint the resume
    will take, written by two processes, as with a ``Path``; a checkpoint path given outright
    is read for it with a run in a bucket too."""
    from glassloop.config.assemble import build

    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"global_batch": 32, "world_size": 2}')
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-00000004")
    cfg = load_config(None, ["data.name=synthetic", "data.num_samples=320", "data.batch_size=8"])
    for run_dir, resume in [
        (str(tmp_path / "run"), "auto"),
        (tmp_path / "run", "auto"),
        ("memory://bucket/run", str(step)),
    ]:
        run = build(cfg, run_dir=run_dir, resume=resume)
        assert run.train_loader.batch_size == 32, (run_dir, resume)  # type: ignore[attr-defined]
    assert build(cfg, run_dir=str(tmp_path / "run")).train_loader.batch_size == 8  # type: ignore[attr-defined]
