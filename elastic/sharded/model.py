"""The loop's sharded model: ``parallelize(model, mesh)`` on every world, and an optimizer
rebuilt on each world's sharding.

A world's model cannot be re-sharded in place: ``fully_shard`` fixes a module's mesh when it
is applied, and a mesh is made of one world's process groups. So the loop keeps a
*skeleton* of the user's model (its parameters on the ``meta`` device, its buffers real: no
memory but the buffers), and on every world it builds the model anew: a copy of the
skeleton, ``parallelize(copy, mesh)`` with a :class:`~torch.distributed.device_mesh.DeviceMesh`
of that world, ``to_empty()`` on the worker's device, and a new optimizer from the user's
callable. The new shards are then filled from the old world's (:mod:`~elastic.sharded.reshard`)
or from storage. The first world's shards are cut from the model the script passed (never changed
itself).

The mesh is 1-D (``("shard",)``: FSDP) or, with ``replicate=R``, 2-D
``("replicate", "shard")`` (HSDP), with as many replica groups as the world size allows: the
largest divisor of the world size not above ``R`` (:func:`~elastic.sharded.plan.hsdp_replicas`).
Ranks fill the mesh row by row, in the world's node-major rank order, so the replicas of a
shard are ``S`` ranks apart: on different nodes whenever a node has at most ``S`` workers.

What is *sharded* here is every ``DTensor`` parameter with one ``Shard`` placement and every
optimizer state tensor laid out like its parameter (Adam's moments). The rest (parameters
that stay whole, buffers, the optimizer's step counts and hyper-parameters, the scheduler)
is small and replicated: it travels whole (:meth:`ShardedTraining.small_state`).
"""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import torch_private
from elastic.sharded.plan import hsdp_replicas, shard_range
from elastic_errors import ConfigError

__all__ = ["Built", "Entry", "ShardedTrainState", "ShardedTraining", "forget_old_meshes",
           "make_mesh", "meta_copy"]

logger = logging.getLogger(__name__)

Parallelize = Callable[[nn.Module, DeviceMesh], nn.Module | None]
OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters live on the ``meta`` device (no memory);
    buffers are copied with their values. Shared parameters stay shared."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                       requires_grad=param.requires_grad)
    return copy.deepcopy(module, memo)


def forget_old_meshes() -> None:
    """Clears torch's DTensor caches before a new world's mesh is used
    (:func:`torch_private.clear_dtensor_caches`: an equal mesh of an earlier world would
    otherwise be handed to the new world's tensors, with this process's old coordinate, and
    a checkpoint's shard offsets would be wrong)."""
    missing = torch_private.clear_dtensor_caches()
    if missing:
        logger.warning("torch has no %s to clear: DTensor operations of a new world may "
                       "reuse an old world's mesh", ", ".join(missing))


def make_mesh(device_type: str, world_size: int, replicate: int) -> DeviceMesh:
    """The mesh of a world: 1-D ``("shard",)``, or 2-D ``("replicate", "shard")`` when the
    world holds more than one replica group (a collective: every rank calls it)."""
    groups = hsdp_replicas(world_size, replicate)
    if groups == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (groups, world_size // groups),
                            mesh_dim_names=("replicate", "shard"))


@dataclass(frozen=True, slots=True)
class Entry:
    """One sharded tensor of the state, as every rank of a world names it.

    Attributes:
        name: ``"p:<fqn>"`` (a parameter) or ``"o:<fqn>:<key>"`` (an optimizer state).
        shape: Global shape.
        dtype: Element type.
        dim: The sharded dimension.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int

    @property
    def rows(self) -> int:
        """Rows along the sharded dimension."""
        return self.shape[self.dim]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        count = 1
        for index, size in enumerate(self.shape):
            if index != self.dim:
                count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def _shard_placement(tensor: DTensor) -> tuple[int, int] | None:
    """``(mesh dim, tensor dim)`` of the tensor's one ``Shard`` placement, ``None`` if it is
    replicated.

    Raises:
        ConfigError: If it is sharded on more than one mesh dimension.
    """
    found = [(m, p.dim) for m, p in enumerate(tensor.placements) if isinstance(p, Shard)]
    if len(found) > 1:
        raise ConfigError(
            f"a parameter is sharded on {len(found)} mesh dimensions ({tensor.placements}); "
            "in-place re-sharding supports one sharded dimension (FSDP or HSDP): shard each "
            "parameter on one mesh dimension only."
        )
    return found[0] if found else None


def _optimizer_state_key(key: Any) -> str:
    if not isinstance(key, str):
        raise ConfigError(f"optimizer state key ({key!r}) is not a string; in-place "
                          "re-sharding needs string keys, as torch's optimizers use.")
    return key


@dataclass(eq=False)
class Built:
    """One world's model, optimizer and scheduler.

    Attributes:
        module: The parallelized model.
        optimizer: Its optimizer.
        scheduler: Its LR scheduler (``None``: none).
        mesh: The world's mesh.
        shards: Shards each sharded tensor is cut in.
        index: This rank's shard.
        shard_index: The shard index of every rank of the world (by rank).
        params: Parameters by name, as built (FSDP swaps them during forward and backward).
        from_weights: Its shards were cut from the script's model's initial weights.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    mesh: DeviceMesh
    shards: int
    index: int
    shard_index: tuple[int, ...]
    params: dict[str, nn.Parameter]
    from_weights: bool
    _entries: list[Entry] = field(default_factory=list)

    def sharded_params(self) -> list[Entry]:
        """The sharded parameters, in the module's order."""
        out = []
        for name, param in self.params.items():
            if isinstance(param, DTensor) and (where := _shard_placement(param)) is not None:
                out.append(Entry(f"p:{name}", tuple(param.shape), param.dtype, where[1]))
        return out

    def optimizer_entries(self) -> list[Entry]:
        """The optimizer's state tensors laid out like their parameters."""
        out = []
        for name, param in self.params.items():
            if not isinstance(param, DTensor) or _shard_placement(param) is None:
                continue
            state = self.optimizer.state.get(param, {})
            for key in sorted(state, key=str):
                value = state[key]
                if (isinstance(value, DTensor) and value.placements == param.placements
                        and value.shape == param.shape):
                    dim = _shard_placement(value)
                    assert dim is not None
                    out.append(Entry(f"o:{name}:{_optimizer_state_key(key)}",
                                     tuple(value.shape), value.dtype, dim[1]))
        return out

    def entries(self) -> list[Entry]:
        """Every sharded tensor: parameters, then optimizer states."""
        return [*self.sharded_params(), *self.optimizer_entries()]

    def local(self, name: str) -> torch.Tensor:
        """This rank's shard of the sharded tensor ``name`` (its memory, not a copy)."""
        kind, _, rest = name.partition(":")
        if kind == "p":
            tensor: Any = self.params[rest]
        else:
            fqn, _, key = rest.rpartition(":")
            tensor = self.optimizer.state[self.params[fqn]][key]
        assert isinstance(tensor, DTensor)
        return tensor.to_local()

    def locals(self) -> dict[str, torch.Tensor]:
        """Every sharded tensor's local shard, by name."""
        return {entry.name: self.local(entry.name) for entry in self.entries()}

    def add_optimizer_entries(self, specs: list[list[str]]) -> None:
        """Creates (zeroed) optimizer states ``[fqn, key, dtype]`` laid out like their
        parameters, for a rank whose optimizer has not stepped yet (a newcomer)."""
        for fqn, key, dtype_name in specs:
            param = self.params[fqn]
            dtype = getattr(torch, dtype_name)
            state = self.optimizer.state[param]
            current = state.get(key)
            if not (isinstance(current, DTensor) and current.dtype == dtype):
                state[key] = torch.zeros_like(param, dtype=dtype,
                                              memory_format=torch.preserve_format)


class ShardedTrainState(Stateful):
    """The current world's model and optimizer as one DCP ``Stateful`` (what the managed
    loop checkpoints under ``"train"``): ``get_state_dict``'s FQN-keyed, DTensor-sharded
    state, which DCP loads into any world size."""

    def __init__(self, training: ShardedTraining) -> None:
        self._training = training

    @property
    def model(self) -> nn.Module | None:
        """The current world's module (``None`` before the first world)."""
        built = self._training.current
        return built.module if built is not None else None

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The current world's optimizer (``None`` before the first world)."""
        built = self._training.current
        return built.optimizer if built is not None else None

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        built = self._training.require()
        model_sd, optim_sd = get_state_dict(built.module, built.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        built = self._training.require()
        set_state_dict(built.module, built.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class CurrentScheduler(Stateful):
    """The current world's LR scheduler as a ``Stateful`` (checkpointed under
    ``"scheduler"``)."""

    def __init__(self, training: ShardedTraining) -> None:
        self._training = training

    def state_dict(self) -> dict[str, Any]:
        built = self._training.require()
        return dict(built.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._training.require().scheduler.load_state_dict(state_dict)


class ShardedTraining:
    """The model, optimizer and scheduler of the current world, and how to build the next.

    Args:
        module: The script's model, with its initial weights (the first world shards it).
        parallelize: ``fn(model, mesh) -> model`` (e.g. ``fully_shard`` per layer, then on
            the root); a ``None`` result means the model was changed in place.
        optimizer: ``fn(params) -> Optimizer``.
        scheduler: ``fn(optimizer) -> LR scheduler`` (``None``: none).
        replicate: Replica groups wanted (HSDP when above 1).
        on_optimizer: Called with every optimizer built (the loop hooks its steps).

    Raises:
        ConfigError: On invalid values.
    """

    def __init__(self, module: nn.Module, *, parallelize: Parallelize,
                 optimizer: OptimizerFactory, scheduler: SchedulerFactory | None = None,
                 replicate: int = 1,
                 on_optimizer: Callable[[torch.optim.Optimizer], None] | None = None) -> None:
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise ConfigError(
                f"with parallelize=, optimizer= must be a callable of the parameters (got "
                f"{type(optimizer).__name__}), e.g. lambda params: torch.optim.AdamW(params, "
                "lr=1e-3), so that the loop can rebuild it on each world's sharding."
            )
        if scheduler is not None and (hasattr(scheduler, "state_dict")
                                      or not callable(scheduler)):
            raise ConfigError(
                f"with parallelize=, scheduler= must be a callable of the optimizer (got "
                f"{type(scheduler).__name__}), e.g. lambda opt: StepLR(opt, 100), so that the "
                "loop can rebuild it with each world's optimizer."
            )
        if replicate < 1:
            raise ConfigError(f"replicate ({replicate}) must be at least 1.")
        self.parallelize = parallelize
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.replicate = replicate
        self._on_optimizer = on_optimizer
        if any(p.device.type == "meta" for p in module.parameters()):
            raise ConfigError(
                "model= has parameters on the meta device; with parallelize= pass the model "
                "with its initial weights (the loop shards them on the first world)."
            )
        self._initial: nn.Module | None = module
        self._skeleton = meta_copy(module)
        self._buffers = {name: buf.detach().clone()
                         for name, buf in self._skeleton.named_buffers()}
        #: The current world's model, optimizer and scheduler (``None`` before the first).
        self.current: Built | None = None
        #: Makes a world's mesh: ``(device type, world size, replicate) -> DeviceMesh`` (the
        #: in-place loop registers the mesh's groups with the world's abort).
        self.mesh_builder: Callable[[str, int, int], DeviceMesh] = make_mesh

    def require(self) -> Built:
        """The current world's :class:`Built`.

        Raises:
            RuntimeError: Before the first world is built.
        """
        if self.current is None:
            raise RuntimeError("the sharded model is built when the loop enters its first "
                               "world; use loop.model inside the loop.")
        return self.current

    def build(self, device: torch.device, world_size: int) -> Built:
        """Builds a world's model on a new mesh (a collective), not yet installed.

        The model is a skeleton copy passed through ``parallelize``, its shards allocated on
        ``device`` and its buffers given the values the script's model had. Until a world is
        installed (:meth:`install`), its shards are cut from the script's model's weights
        (each rank copies its own rows: the script's model is never changed, so a build that
        fails leaves them for the next); later worlds' are filled by the heal or from storage.

        Raises:
            ConfigError: If ``parallelize`` shards a parameter on several mesh dimensions.
        """
        forget_old_meshes()
        mesh = self.mesh_builder(device.type, world_size, self.replicate)
        source = meta_copy(self._skeleton)
        module = self.parallelize(source, mesh) or source
        module.to_empty(device=device)
        initial = self._initial
        with torch.no_grad():
            buffers = (dict(initial.named_buffers()) if initial is not None
                       else self._buffers)
            for name, buf in module.named_buffers():
                if name in buffers:
                    buf.copy_(buffers[name])
            if initial is not None:
                _cut_weights(dict(initial.named_parameters()), module)
        params = dict(module.named_parameters())
        optimizer = self.optimizer_factory(iter(params.values()))
        scheduler = (self.scheduler_factory(optimizer) if self.scheduler_factory is not None
                     else None)
        if self._on_optimizer is not None:
            self._on_optimizer(optimizer)
        shards, index, shard_index = _mesh_shards(mesh, params)
        return Built(module=module, optimizer=optimizer, scheduler=scheduler, mesh=mesh,
                     shards=shards, index=index, shard_index=shard_index, params=params,
                     from_weights=initial is not None)

    def install(self, built: Built) -> None:
        """Makes ``built`` the current world's (the previous one is dropped, and so is the
        script's model once a world holds its weights)."""
        self.current = built
        if built.from_weights:
            self._initial = None
        # FSDP's modules and hooks form reference cycles: collect the old world's now, which
        # frees its shards at once (and never lets the interpreter's exit collect process
        # groups that torch.distributed already destroyed, which aborts the process).
        gc.collect()

    # -- the small, replicated part of the state --------------------------------------------

    @staticmethod
    def small_state(built: Built) -> dict[str, Any]:
        """Everything of ``built`` that is not sharded, as plain values (a new dict, with
        tensors that are the live ones: copy it to keep it)."""
        sharded = {e.name for e in built.entries()}
        optim_keys: list[list[str]] = []
        scalars: dict[str, dict[str, Any]] = {}
        for name, param in built.params.items():
            for key, value in built.optimizer.state.get(param, {}).items():
                label = f"o:{name}:{_optimizer_state_key(key)}"
                if label in sharded:
                    optim_keys.append([name, key, str(value.dtype).removeprefix("torch.")])
                else:
                    scalars.setdefault(name, {})[key] = value
        whole: dict[str, torch.Tensor] = {}
        for name, param in built.params.items():
            if f"p:{name}" not in sharded:
                whole[f"p:{name}"] = (param.to_local() if isinstance(param, DTensor)
                                      else param).detach()
        for name, buf in built.module.named_buffers():
            whole[f"b:{name}"] = buf.detach()
        groups = [{k: v for k, v in group.items() if k != "params"}
                  for group in built.optimizer.param_groups]
        return {
            "optim_keys": optim_keys,
            "optim_groups": groups,
            "optim_scalars": scalars,
            "whole": whole,
            "scheduler": (dict(built.scheduler.state_dict()) if built.scheduler is not None
                          else None),
        }

    @staticmethod
    def load_small_state(built: Built, small: dict[str, Any]) -> None:
        """Loads :meth:`small_state` into ``built`` (its sharded optimizer states must exist).

        Raises:
            ValueError: If the optimizer's parameter groups do not match.
        """
        groups = small["optim_groups"]
        if len(groups) != len(built.optimizer.param_groups):
            raise ValueError(
                f"the state has {len(groups)} optimizer parameter groups but this rank's "
                f"optimizer has {len(built.optimizer.param_groups)}; every rank must build "
                "the same optimizer."
            )
        for group, saved in zip(built.optimizer.param_groups, groups, strict=True):
            group.update(saved)
        for name, entries in small["optim_scalars"].items():
            state = built.optimizer.state[built.params[name]]
            for key, value in entries.items():
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        buffers = dict(built.module.named_buffers())
        with torch.no_grad():
            for label, value in small["whole"].items():
                kind, _, name = label.partition(":")
                if kind == "b":
                    target: torch.Tensor = buffers[name]
                else:
                    param = built.params[name]
                    target = param.to_local() if isinstance(param, DTensor) else param
                target.copy_(value)
        if small["scheduler"] is not None and built.scheduler is not None:
            built.scheduler.load_state_dict(small["scheduler"])


def _cut_weights(full: dict[str, nn.Parameter], module: nn.Module) -> None:
    """Copies each parameter's rows of this rank's shard from the full weights (``torch.chunk``
    along the sharded dimension, as ``fully_shard`` cuts them)."""
    for name, param in module.named_parameters():
        source = full[name].detach()
        if not isinstance(param, DTensor):
            param.copy_(source)
            continue
        where = _shard_placement(param)
        if where is None:
            param.to_local().copy_(source)
            continue
        mesh_dim, dim = where
        start, stop = shard_range(source.shape[dim], param.device_mesh.size(mesh_dim),
                                  param.device_mesh.get_local_rank(mesh_dim))
        param.to_local().copy_(source.narrow(dim, start, stop - start))


def _mesh_shards(mesh: DeviceMesh, params: dict[str, nn.Parameter]
                 ) -> tuple[int, int, tuple[int, ...]]:
    """``(shards, this rank's shard, every rank's shard)`` of the parameters' sharding.

    Raises:
        ConfigError: If parameters are sharded on different mesh dimensions or meshes.
    """
    dims = set()
    for param in params.values():
        if isinstance(param, DTensor):
            if param.device_mesh is not mesh and param.device_mesh != mesh:
                raise ConfigError("parallelize() put a parameter on a mesh other than the "
                                  "one the loop passed; shard everything on that mesh.")
            where = _shard_placement(param)
            if where is not None:
                dims.add(where[0])
    if len(dims) > 1:
        raise ConfigError(f"parameters are sharded on different mesh dimensions "
                          f"({sorted(dims)}); shard every parameter on one.")
    if not dims:
        return 1, 0, tuple(0 for _ in range(mesh.size()))
    (dim,) = dims
    ranks = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim))
    shard_index = [0] * mesh.size()
    for row in ranks.tolist():
        for index, rank in enumerate(row):
            shard_index[rank] = index
    return mesh.size(dim), mesh.get_local_rank(dim), tuple(shard_index)
