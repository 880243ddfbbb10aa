"""FSDP2 (``train.strategy = "fsdp"``): parameters, gradients and optimizer state sharded over
torchrun's processes with PyTorch's ``fully_shard``, and checkpoints written through
``torch.distributed.checkpoint`` (DCP), each process writing its own shard.

Sharding (:func:`shard_model`): every module inside an ``nn.ModuleList`` (where transformer
blocks live) is its own unit, or, in a model without one, every direct child that holds
parameters; then the model itself (embeddings, head, the rest). A unit's parameters are
gathered for its forward and backward and freed after, so a process holds one unit's full
weights at a time plus its shard of everything. Gradients are reduce-scattered and averaged
over processes, as DDP averages them. ``train.precision = "bf16"`` becomes FSDP's
``MixedPrecisionPolicy`` (bf16 parameters in forward/backward, fp32 gradient reduction and
fp32 sharded weights) under the same autocast as the other strategies. A model already
sharded by the user (``fully_shard`` called on it) is used as it is.

Checkpoints (:class:`ShardedState`): the model's and the optimizer's tensors go to the
checkpoint's ``shards/`` folder through DCP's safetensors writer
(``HuggingFaceStorageWriter(save_distributed=True)``: one safetensors file per process, each
chunk's offsets in its header) and come back through its reader, which rebuilds DCP's
metadata from those headers. So no pickle is written or read: DCP's default
``FileSystemWriter`` keeps its metadata in a pickle, which glassloop would have to unpickle on
resume. Everything else (the optimizer's hyper-parameters, the loop, the RNG) is in the
checkpoint's JSON and safetensors files like in any other run. Because DCP stores each
tensor's global shape and each chunk's place in it, a checkpoint loads into any number of
processes (resharding), also into one process without a process group (``glassloop export``
gathers the full weights that way).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import glassloop.distributed.preemption as preemption
from glassloop.batch import required_inputs, split_batch, split_inputs
from glassloop.device import move_to_device
from glassloop.distributed.world import (
    World,
    agreed_stop,
    all_reduce,
    distributed_job,
    track_sharded,
)
from glassloop.errors import CheckpointError, ConfigError, DataError

MODEL = "model."  # key prefixes in a checkpoint's shards/ folder
OPTIMIZER = "optimizer."


# torch's FSDP, DTensor and DCP are imported where they are used, not here: importing them
# took ~1.3 s of every start (each `glassloop` command, each torchrun worker), and a sharded
# model or a DTensor cannot exist before its module was imported, so the checks below look
# for the module instead of importing it.
def _imported(module: str, name: str) -> Any:
    """``module.name`` if ``module`` is imported already, else ``None``."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``)."""
    fsdp_module = _imported("torch.distributed.fsdp", "FSDPModule")
    return fsdp_module is not None and isinstance(model, fsdp_module)


def _is_dtensor(tensor: Any) -> bool:
    dtensor = _imported("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def check_options(*, precision: str, ema: bool, compile: bool) -> None:
    """Refuse what FSDP runs do not support here, with what to do instead."""
    if precision == "fp16":
        raise ConfigError(
            "config: train.precision = 'fp16' is not supported with train.strategy = 'fsdp' "
            "(the GradScaler would decide on overflow from each process's shard alone); "
            "use 'bf16', which needs no loss scaling"
        )
    if ema:
        raise ConfigError(
            "config: train.ema_decay is not supported with train.strategy = 'fsdp' (the "
            "average would be a full copy of the model on every process); use 'ddp'"
        )
    if compile:
        raise ConfigError(
            "config: train.compile is not supported with train.strategy = 'fsdp' yet (compile "
            "each block before sharding it yourself, in Python); set train.compile = false"
        )


def units(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard_model` shards one by one, before the model itself."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return [block for blocks in lists for block in blocks if _has_parameters(block)]
    return [child for child in model.children() if _has_parameters(child)]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    world: World,
    device: torch.device,
    precision: str,
) -> nn.Module:
    """``fully_shard`` the units of ``model`` and then the model, over all processes; point
    ``optimizer`` at the sharded parameters.

    ``fully_shard`` replaces each parameter with a sharded one (a ``DTensor``), so an
    optimizer built before it would update tensors the model no longer uses. Its groups keep
    their hyper-parameters and order; each parameter is swapped for the sharded one of the
    same name. An optimizer that has already stepped is refused (its state is per tensor)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        return model  # sharded by the user, who built the optimizer after it
    if optimizer.state:
        raise ConfigError(
            "config: train.strategy = 'fsdp' needs an optimizer that has not stepped yet "
            "(its state belongs to the unsharded parameters); build it fresh"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError(
            "config: the optimizer holds a parameter that is not the model's; FSDP can only "
            "shard the model's own parameters"
        )
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world.size,))
    policy = MixedPrecisionPolicy()
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in reversed(units(model)):  # inner blocks (nested lists) before the outer ones
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    track_sharded(model)  # its FSDP state is released at exit (distributed.shutdown)
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return model


def class_name(model: nn.Module) -> str:
    """The model's class name (FSDP2 renames a sharded module's class ``FSDP<name>``: the
    same model, sharded or not, has the same name)."""
    name = type(model).__name__
    return name.removeprefix("FSDP") if is_sharded(model) else name


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Reduce gradients across processes in this block's backward only when ``enabled``
    (the last micro-batch of an accumulation window): DDP's ``no_sync()``, FSDP2's
    ``set_requires_gradient_sync``. In one process, nothing (a shared ``nullcontext``: the
    step's hot path pays one call)."""
    if enabled:
        return _AS_IS
    if is_sharded(model):
        return _fsdp_sync_off(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return _AS_IS


_AS_IS = contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_sync_off(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor (the tensor itself when it is not sharded)."""
    return cast(Any, tensor).to_local() if _is_dtensor(tensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (a collective: every process calls it)."""
    return cast(Any, tensor).full_tensor() if _is_dtensor(tensor) else tensor


def all_finite(model: nn.Module) -> bool:
    """Whether every floating-point weight is finite, in every process (a collective)."""
    bad = 0.0
    for tensor in model.state_dict().values():
        part = local(tensor)
        if part.is_floating_point() and not bool(part.isfinite().all()):
            bad = 1.0
            break
    return not all_reduce(torch.tensor([bad]), "max").item()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole weights on the CPU in rank 0 (``{}`` elsewhere); a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


class ShardedState:
    """The model's and the optimizer's tensors of an FSDP run, as one stateful part of its
    checkpoints (:meth:`glassloop.Trainer.stateful` lists it as ``"optimizer"``).

    :meth:`state_dict` is what goes to the checkpoint's JSON: the optimizer's
    hyper-parameters by group, its parameters named by their fully qualified names.
    :meth:`save` writes the tensors, each process its shard (a collective).
    :meth:`load_state_dict` reads them from ``source`` (the checkpoint's ``shards/``, set by
    whoever resumes) into this run's own sharding, whatever it was saved with.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.source: Path | None = None

    def _tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """This run's tensors by checkpoint key, and the two state dicts they came from
        (DCP's: keys are parameter names, the same for any sharding)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_dict = get_state_dict(self.model, self.optimizer)
        optim_state = cast(dict[str, Any], optim_dict)
        flat = {MODEL + name: cast(torch.Tensor, tensor) for name, tensor in model_state.items()}
        for name, values in optim_state["state"].items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    flat[f"{OPTIMIZER}{name}.{key}"] = value
        return flat, cast(dict[str, Any], model_state), optim_state

    def state_dict(self) -> dict[str, Any]:
        _, _, optim_state = self._tensors()
        return {
            "param_groups": optim_state["param_groups"],
            "other": {  # per-parameter state that is not a tensor (rare)
                name: {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
                for name, values in optim_state["state"].items()
            },
        }

    def save(self, directory: Path) -> None:
        """Write this process's shard of every tensor into ``directory`` (all processes)."""
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        flat, _, _ = self._tensors()
        writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
        with quiet_single_process():
            dcp_save(flat, storage_writer=writer, no_dist=not distributed_job())

    def save_async(self, directory: Path, group: Any) -> Future[Any]:
        """:meth:`save` in the background: this process's shards copied to host memory now
        (what the step waits for), written into ``directory`` by DCP's own thread and
        coordinated over ``group`` (the checkpoints' process group: its collectives never meet
        training's); the future of the write (all processes)."""
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save

        flat, _, _ = self._tensors()
        writer = HuggingFaceStorageWriter(str(directory), save_distributed=True)
        with quiet_single_process():
            written = async_save(
                flat, storage_writer=writer, process_group=group, no_dist=not distributed_job()
            )
        return cast("Future[Any]", written)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        if self.source is None:
            raise CheckpointError("checkpoint: no shards to load the FSDP state from")
        flat, model_state, optim_state = self._tensors()  # this run's own layout
        try:
            reader = HuggingFaceStorageReader(str(self.source))
            with quiet_single_process():
                dcp_load(flat, storage_reader=reader, no_dist=not distributed_job())
        except Exception as err:  # DCP wraps every failure in its own CheckpointException
            raise CheckpointError(
                f"checkpoint: the shards in '{self.source}' do not fit this model and "
                f"optimizer: {str(err).splitlines()[0][:300]}"
            ) from err
        for name in model_state:
            model_state[name] = flat[MODEL + name]
        for name, values in optim_state["state"].items():
            for key in values:
                if f"{OPTIMIZER}{name}.{key}" in flat:
                    values[key] = flat[f"{OPTIMIZER}{name}.{key}"]
            values.update(saved["other"].get(name, {}))
        optim_state["param_groups"] = saved["param_groups"]
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state
        )


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without DCP's warning that it saves or loads in one process: that is what was asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def read_full_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model from a checkpoint's ``shards/``, gathered in this one process (no
    process group): every tensor allocated at its global shape and filled from the chunks."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = HuggingFaceStorageReader(str(directory))
    try:
        metadata = reader.read_metadata()
        tensors = {
            key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(MODEL) and isinstance(entry, TensorStorageMetadata)
        }
        with quiet_single_process():
            dcp_load(tensors, storage_reader=reader, no_dist=True)
    except Exception as err:
        raise CheckpointError(
            f"checkpoint: cannot gather the weights in '{directory}': "
            f"{str(err).splitlines()[0][:300]}"
        ) from err
    return {key[len(MODEL) :]: tensor for key, tensor in tensors.items()}


def evenly(
    model: nn.Module,
    batches: Iterable[Any],
    device: torch.device,
    *,
    own_loss: bool = False,
    predicting: bool = False,
) -> Iterable[Any]:
    """``batches`` as they are, or, for a sharded model, through :func:`even_batches` (when
    they can be counted: ``limit_batches`` keeps the count, see
    :func:`glassloop.evaluation.evaluate.first_batches`). What the evaluation and prediction
    loops of :mod:`glassloop.evaluation.evaluate` run the model over."""
    if not is_sharded(model):
        return batches
    try:
        count = len(batches)  # type: ignore[arg-type]
    except TypeError:  # no len() (a generator; tqdm over one)
        return batches
    return even_batches(batches, count, model, device, own_loss, predicting=predicting)


def even_batches(
    loader: Iterable[Any],
    count: int,
    model: nn.Module,
    device: torch.device,
    own_loss: bool,
    *,
    predicting: bool = False,
) -> Iterator[Any]:
    """The ``count`` batches of ``loader``, then forwards of the last one (results unused)
    until this process has run as many forwards as the process with the most batches.

    Under FSDP every forward is a collective (each unit's weights are gathered from all
    processes), and a validation shard (or each process's data to predict) can have fewer
    batches on some processes; without these extra forwards the others would wait forever.
    The caller has put the model in eval mode. ``predicting``: batches are read as
    ``predict`` reads them (inputs only, a target dropped)."""
    most = int(all_reduce(torch.tensor([count]), "max").item())
    if count == 0 and most:
        raise DataError(
            "data: a process got no batch while others did (fewer samples than processes); "
            "give every process at least one batch, or use fewer processes"
        )
    last: Any = None
    for last in loader:
        agree_on_a_stop()
        yield last
    if most > count:
        batch = move_to_device(last, device)
        if predicting:
            args, kwargs = split_inputs(batch, required_inputs(model))
        else:
            (args, kwargs), _ = split_batch(batch, labels_to_model=own_loss)
        with torch.no_grad():
            for _ in range(most - count):
                agree_on_a_stop()
                model(*args, **kwargs)


def agree_on_a_stop() -> None:
    """Inside a validation in ``fit``, before each of an FSDP evaluation's evened forwards
    (as many in every process): a stop any process received abandons the validation in all
    of them at the same forward (:class:`~glassloop.distributed.preemption.StopRequested`; see
    :class:`glassloop.evaluation.validator.Abandonable`)."""
    if preemption.abandoning():
        signum, _ = agreed_stop(preemption.requested(), True)
        if signum:
            raise preemption.StopRequested(signum)
