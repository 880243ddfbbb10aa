"""From a :class:`~glassloop.config.schema.Config` to a ready :class:`~glassloop.loop.Trainer`.

This is what ``glassloop train`` does before it calls ``fit``; Python users can call it too::

    cfg = glassloop.load_config("recipe.toml", ["optim.lr=3e-4"])
    run = glassloop.build(cfg, run_dir="runs/try1")
    history = run.trainer.fit(run.train_loader, run.validation, epochs=cfg.train.epochs)
"""

from __future__ import annotations

import copy
import functools
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from glassloop.callbacks import Callback, EarlyStopping
from glassloop.config.schema import Config, config_task, to_dict
from glassloop.data import Splits, load_splits, loaders_for_splits, make_loader, pad_collate
from glassloop.data.datasets import npz_validation_sets
from glassloop.data.loaders import InMemoryLoader, ResumableLoader
from glassloop.data.position import keep_global_batch
from glassloop.data.text import TextData, load_text
from glassloop.errors import ConfigError, DataError, ModelError
from glassloop.run_dir import layout
from glassloop.run_dir.checkpoints import latest_pointer

if TYPE_CHECKING:
    from glassloop.data.lazy import DiskData
from glassloop.config.losses import build_loss
from glassloop.config.models import build_model, target_scale_of
from glassloop.config.optimizers import build_optimizer, build_scheduler, schedule_span
from glassloop.device import resolve_device
from glassloop.distributed.world import SINGLE, World, init_from_env, local_device
from glassloop.evaluation.validator import Validation
from glassloop.loop import Trainer
from glassloop.options import OPTIONS, RunInfo
from glassloop.rng import seed_everything
from glassloop.step.guards import NonFinitePolicy
from glassloop.storage.file_names import is_url


@dataclass
class Run:
    """Everything a configured run needs: the resolved config, data, and the trainer."""

    config: Config
    splits: Splits | TextData | DiskData
    train_loader: InMemoryLoader | ResumableLoader
    val_loader: InMemoryLoader | ResumableLoader
    trainer: Trainer
    # data.val_sets: further validation sets by name, each reported as val_<name>_*
    val_sets: dict[str, InMemoryLoader | ResumableLoader] = field(default_factory=dict)
    # What the command says again at its end (a warning above the header scrolls away).
    warnings: list[str] = field(default_factory=list)

    @property
    def validation(self) -> Validation:
        """What ``fit`` validates on: the validation loader, or with ``data.val_sets`` it
        first (its numbers as ``val_*``) and each further set by name."""
        return {"": self.val_loader, **self.val_sets} if self.val_sets else self.val_loader


def model_spec(cfg: Config, data: Splits | TextData | DiskData) -> dict[str, Any]:
    """What :func:`glassloop.load_model` needs to rebuild the model from a weights file."""
    spec = {
        "model": asdict(cfg.model),
        "input_shape": list(data.input_shape),
        "num_classes": data.num_classes,
        "class_names": data.class_names,
        "preprocessing": data.preprocessing,
        "task": config_task(cfg),
    }
    if isinstance(data, TextData):
        spec.update(vocab_size=data.vocab_size, pad_id=data.pad_id)
    return spec


@dataclass
class Built:
    """What a config describes before any training: the data and its loaders, the model and
    the loss (no optimizer, no Trainer, no process group): what ``glassloop eval`` and
    ``report`` need."""

    config: Config
    data: Splits | TextData | DiskData
    train_loader: InMemoryLoader | ResumableLoader
    val_loader: InMemoryLoader | ResumableLoader
    model: nn.Module
    loss_fn: nn.Module
    device: torch.device
    task: str  # what the model is trained to do (glassloop.tasks)
    val_sets: dict[str, InMemoryLoader | ResumableLoader] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what the command says again at its end


def table_data(cfg: Config) -> DiskData | TextData:
    """Parquet shards where they live (a file, a folder, a glob, a URL prefix), streamed
    through this process's cache of decoded row groups (:mod:`glassloop.data.shards`), or a
    Hugging Face dataset's files (:mod:`glassloop.data.hf_datasets`)."""
    if cfg.data.name == "hf":
        from glassloop.data.hf_datasets import hf_data

        return hf_data(cfg.data)
    from glassloop.data.shards import shard_data

    return shard_data(cfg.data)


def lazy_images(cfg: Config) -> DiskData | None:
    if cfg.data.name != "image-folder":
        return None
    from glassloop.data.files import image_folder_on_disk

    return image_folder_on_disk(cfg.data)


# The data names that read each path key (data.root: never refused, a download makes it).
PATH_KEYS = {
    "path": ("npz", "csv", "image-folder", "parquet", "hf", "text-csv"),
    "tokenizer": ("text-csv", "parquet", "hf"),
    "val_sets": ("npz",),
    "root": (),
}


def located(cfg: Config, folder: Path | None) -> Config:
    """A copy of ``cfg`` whose relative paths (``data.path``, ``data.tokenizer``,
    ``data.root``, ``data.val_sets``, a file ``model.target``) work from here for a run
    recorded as started in ``folder``: each is kept when it exists from the current folder,
    else made ``folder / path`` when it exists there; one that this run reads and neither has
    is refused in one line. ``folder=None`` (a new run): the config as it is. (The config a
    run records keeps its paths as written: a resume from its own folder compares equal.)

    >>> cfg = located(Config(), Path("/elsewhere"))  # the demo reads no file of its own
    >>> cfg.data.root
    'data'
    """
    cfg = copy.deepcopy(cfg)
    if folder is None:
        return cfg
    d = cfg.data

    def find(key: str, value: str, needed: bool, written: str = "PATH") -> str:
        if not value or Path(value).is_absolute() or is_url(value) or exists(value):
            return value
        if exists(str(folder / value)):
            return str(folder / value)
        if not needed:
            return value
        error = ModelError if key == "model.target" else DataError
        raise error(
            f"run: {key} '{value}' is neither in the current folder ('{Path.cwd()}') nor in "
            f"the one the run was started in ('{folder}'); put it back there, or give its "
            f"new place (eval, train: --set {key}={written})"
        )

    d.path = find("data.path", d.path, d.name in PATH_KEYS["path"])
    d.val_path = find("data.val_path", d.val_path, d.name in ("parquet", "hf"))
    d.tokenizer = find("data.tokenizer", d.tokenizer, d.name in PATH_KEYS["tokenizer"])
    d.root = find("data.root", d.root, needed=False)
    d.val_sets = {
        name: find(f"data.val_sets.{name}", file, d.name in PATH_KEYS["val_sets"])
        for name, file in d.val_sets.items()
    }
    module, sep, name = cfg.model.target.rpartition(":")
    if sep and module.endswith(".py"):
        module = find("model.target", module, True, f"PATH.py:{name}")
        cfg.model.target = f"{module}:{name}"
    return cfg


def exists(path: str) -> bool:
    """A file or folder at ``path``, or one at least that a glob (``train/*.parquet``) names."""
    import glob

    return bool(glob.glob(path)) if glob.has_magic(path) else Path(path).exists()


def build_parts(cfg: Config, *, world: World = SINGLE, files_from: Path | None = None) -> Built:
    """Seed, load the data, make the loaders, build the model and the loss; ``files_from``:
    the folder a run being read again was started in (:func:`located`)."""
    cfg = located(cfg, files_from)
    device = local_device(resolve_device(cfg.train.device), world)
    seed_everything(cfg.train.seed)  # before building the model: reproducible initial weights
    task = config_task(cfg)
    data: Splits | TextData | DiskData
    val_sets: dict[str, InMemoryLoader | ResumableLoader] = {}  # data.val_sets (npz)
    if cfg.data.val_sets and cfg.data.name != "npz":
        raise ConfigError(
            f"config: data.val_sets reads .npz files (data.name = 'npz'), not {cfg.data.name!r}"
        )
    # Parquet, or image files too many to decode into memory: DiskData (else None).
    on_disk = table_data(cfg) if cfg.data.name in ("parquet", "hf") else lazy_images(cfg)
    texts = load_text(cfg.data) if cfg.data.name == "text-csv" else None
    if isinstance(on_disk, TextData):  # a Parquet text column, tokenized as it is read
        texts, on_disk = on_disk, None
    empty: str | None = None  # (arrays in memory only: classes without a training sample)
    if texts is not None:
        data = texts
        model = build_model(
            cfg.model,
            data.input_shape,
            data.num_classes,
            vocab_size=data.vocab_size,
            pad_id=data.pad_id,
        )
        collate = functools.partial(pad_collate, pad_value=data.pad_id)
        common: dict[str, Any] = {
            "collate_fn": collate,
            "num_workers": cfg.data.num_workers,
            "seed": cfg.train.seed,
            "world": world,
        }
        buckets = cfg.data.bucket_by_length
        # (TextRows: a TextDataset in memory or ParquetTexts on disk, both Datasets)
        train_loader: InMemoryLoader | ResumableLoader = make_loader(
            cast(Dataset[Any], data.train),
            batch_size=cfg.data.batch_size,
            shuffle=cfg.data.shuffle,
            lengths=data.train.lengths if buckets else None,
            **common,
        )
        val_loader: InMemoryLoader | ResumableLoader = make_loader(
            cast(Dataset[Any], data.val),
            batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
            lengths=data.val.lengths if buckets else None,
            shard="strided",
            **common,
        )
    elif on_disk is not None:  # read row by row from disk, in the loader's workers
        if cfg.data.augment:
            raise ConfigError(
                "config: data.augment works on the in-memory path; this data set is read "
                "from disk (parquet, or an image folder above data.in_memory_mb)"
            )
        data = on_disk
        model = build_model(cfg.model, data.input_shape, data.num_classes)
        common = {"num_workers": cfg.data.num_workers, "seed": cfg.train.seed, "world": world}
        train_loader = make_loader(
            data.train, batch_size=cfg.data.batch_size, shuffle=cfg.data.shuffle, **common
        )
        val_loader = make_loader(
            data.val,
            batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
            shard="strided",
            **common,
        )
    else:
        data = load_splits(cfg.data, task)
        if cfg.data.standardize_targets:
            if task != "regression":
                raise ConfigError(
                    f"config: data.standardize_targets is for a regression (loss.name 'mse', "
                    f"'l1', 'huber', 'smooth_l1'); this run's task is {task}"
                )
            standardize_targets(data)
        scale = target_scale_of(data.preprocessing)
        if task == "classification":
            empty = warn_empty_classes(data)
        model = build_model(cfg.model, data.input_shape, data.num_classes, target_scale=scale)
        train_loader, val_loader = loaders_for_splits(
            data,
            batch_size=cfg.data.batch_size,
            eval_batch_size=cfg.data.eval_batch_size or None,
            shuffle=cfg.data.shuffle,
            num_workers=cfg.data.num_workers,
            seed=cfg.train.seed,
            device=device,
            augment=cfg.data.augment,
            world=world,
        )
        val_sets = {  # data.val_sets (npz): each further set's loader, as the validation's
            name: make_loader(
                tensors,
                batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                shard="strided",
                num_workers=cfg.data.num_workers,
                seed=cfg.train.seed,
                world=world,
            )
            for name, tensors in npz_validation_sets(cfg.data, task, data).items()
        }
    loss_fn = build_loss(
        cfg.loss, num_outputs=data.num_classes, ignore_index=cfg.train.ignore_index
    )
    return Built(
        cfg,
        data,
        train_loader,
        val_loader,
        model,
        loss_fn.to(device),
        device,
        task,
        val_sets,
        [empty] if empty else [],
    )


def warn_empty_classes(data: Splits) -> str | None:
    """One line (printed, and returned: the command repeats it at its end) when a class the
    model gets an output for has no training sample: labels 1..10 make 11 outputs, and class
    0 is never learned (what ``glassloop doctor`` calls the class balance; a model of the
    user's, with 10 outputs, is stopped by the first-batch guard instead)."""
    labels = data.y_train
    if labels.ndim != 1 or labels.is_floating_point() or not len(labels):
        return None
    counts = torch.bincount(labels.clamp(min=0), minlength=data.num_classes)
    empty = (counts[: data.num_classes] == 0).nonzero().flatten().tolist()
    if empty:
        low, high = int(labels.min()), int(labels.max())
        start = "; labels that start at 1 need 1 subtracted" if empty[0] == 0 and low == 1 else ""
        said = (
            f"warning: data: classes {empty[:10]} have no training samples (labels "
            f"{low}..{high}, {data.num_classes} outputs): they can never be learned{start}"
        )
        print(said)
        return said
    return None


def standardize_targets(data: Splits) -> None:
    """Record the training targets' mean and std per output in ``data.preprocessing`` (the
    model learns them standardised: :class:`glassloop.config.models.TargetScale`; the data itself
    is not changed)."""
    y = data.y_train.double().reshape(len(data.y_train), -1)
    std = y.std(dim=0, unbiased=False)
    std[std == 0] = 1.0  # a constant target: nothing to scale
    data.preprocessing["target_mean"] = y.mean(dim=0).tolist()
    data.preprocessing["target_std"] = std.tolist()


def target_scale_note(data: Splits | TextData | DiskData, task: str) -> str | None:
    """One line when a regression's targets are far from standardised and nothing
    standardises them (a fresh model outputs values near 0)."""
    if task != "regression" or not isinstance(data, Splits):
        return None
    if "target_mean" in data.preprocessing or not len(data.y_train):
        return None
    y = data.y_train.double().reshape(len(data.y_train), -1)
    mean, std = y.mean(dim=0), y.std(dim=0, unbiased=False)
    if bool(((mean.abs() <= 3 * std.clamp(min=1e-12)) & (std < 10) & (std > 0.1)).all()):
        return None
    return (
        f"warning: the regression targets have mean {fmt_values(mean)} and std "
        f"{fmt_values(std)}, far from a fresh model's outputs (near 0, unit scale): it spends "
        "its first epochs reaching them; data.standardize_targets = true learns them "
        "standardised (every number stays in the targets' units)"
    )


def fmt_values(values: torch.Tensor) -> str:
    shown = ", ".join(f"{v:.4g}" for v in values.tolist()[:4])
    return shown + (", ..." if len(values) > 4 else "")


def trainer_options(cfg: Config) -> dict[str, Any]:
    """The Trainer's arguments a config sets: every option of the table
    (:class:`glassloop.options.TrainOptions`) read from ``[train]``, but for the three
    ``build()`` passes itself (the seed, before the model is built; the device, resolved;
    the task, with the loss), with the ``[train]`` keys that fold into one argument folded
    (``nonfinite`` + ``max_nonfinite_skips``, ``compile`` + ``compile_mode`` +
    ``compile_dynamic``), and the scheduler's interval, tracking and checkpointing."""
    t = cfg.train
    options = {name: getattr(t, name) for name in sorted(OPTIONS - BUILT_HERE)}
    options.update(
        nonfinite=NonFinitePolicy(t.nonfinite, t.max_nonfinite_skips),
        compile={"mode": t.compile_mode, "dynamic": t.compile_dynamic} if t.compile else False,
        scheduler_interval=cfg.scheduler.interval,
        tracking=cfg.tracking,
        checkpoint=cfg.checkpoint,
    )
    return options


# The options build() passes to the Trainer itself, not as [train] holds them.
BUILT_HERE = frozenset({"seed", "device", "task"})


def build(
    cfg: Config,
    *,
    run_dir: str | Path | None = None,
    files_from: Path | None = None,
    resume: str | Path | None = None,
) -> Run:
    """Join torchrun's process group (if any), build the parts (:func:`build_parts`, with
    ``files_from``), the optimizer and scheduler, and return a :class:`Run` with its
    Trainer; ``resume``: what the run will resume from (a loader keeps its global batch)."""
    device = resolve_device(cfg.train.device)
    world = init_from_env(device, strategy=cfg.train.strategy, timeout_s=cfg.train.dist_timeout_s)
    parts = build_parts(cfg, world=world, files_from=files_from)
    data, model, device = parts.data, parts.model, parts.device
    # What the run records and a resume compares: the paths as written, not as located.
    cfg = copy.deepcopy(cfg)
    train_loader, val_loader = parts.train_loader, parts.val_loader
    # The checkpoint the resume will take, when it is on this disk already: a path; or the
    # run directory's newest (a run in a bucket: its local copy is made later, by the Trainer).
    local = run_dir is not None and not is_url(str(run_dir))
    if resume is not None and (str(resume) != "auto" or local):
        found = latest_pointer(Path(str(run_dir))) if str(resume) == "auto" else Path(resume)
        keep_global_batch(train_loader, world, found / layout.META if found else None)
    optimizer = build_optimizer(model, cfg.optim)
    # Optimizer steps per epoch: one per window of grad_accum_steps batches (the last may be
    # shorter).
    batches = min(len(train_loader), cfg.train.limit_batches or len(train_loader))
    steps_per_epoch = -(-batches // cfg.train.grad_accum_steps)
    span = schedule_span(cfg.scheduler, cfg.train.epochs, steps_per_epoch)
    scheduler = build_scheduler(optimizer, cfg.scheduler, span)
    # The resolved config records the length the schedule got (the caller's config is not
    # changed: parts.config is a copy).
    cfg.scheduler.kwargs = {**cfg.scheduler.kwargs, **span}
    callbacks: list[Callback] = []
    stop = cfg.early_stopping
    if stop.monitor:
        callbacks.append(
            EarlyStopping(
                stop.monitor, patience=stop.patience, min_delta=stop.min_delta, mode=stop.mode
            )
        )
    trainer = Trainer(
        model,
        optimizer,
        parts.loss_fn,
        scheduler=scheduler,
        task=parts.task,
        device=device,
        run_dir=run_dir,
        callbacks=callbacks,
        world=world,
        run_info=RunInfo(to_dict(cfg), model_spec(cfg, data)),
        **trainer_options(cfg),
    )
    if (note := target_scale_note(data, parts.task)) is not None:
        trainer.console.message(note)
    return Run(cfg, data, train_loader, val_loader, trainer, parts.val_sets, parts.warnings)
