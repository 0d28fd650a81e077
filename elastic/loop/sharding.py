"""Sharded models in the loop (``ElasticLoop(parallelize=...)``): FSDP2 and HSDP, in place.

:class:`ShardedWay` is the part of :class:`~elastic.loop.ElasticLoop` behind ``parallelize=``,
``replicate=``, ``redundancy=`` and ``snapshot_every=``: it builds the model on every world
(:mod:`elastic.sharded.model`), heals a new world by re-sharding the survivors' shards and
copies (:mod:`elastic.sharded.reshard`), and keeps each shard's copy in a peer's host memory
(:mod:`elastic.sharded.copies`). See ``docs/sharded.md``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from elastic.inplace.heal import HealResult, load_state
from elastic.loop.loop_state import LoopState
from elastic.sharded.copies import ShardCopies
from elastic.sharded.model import (
    Built,
    CurrentScheduler,
    ShardedTraining,
    ShardedTrainState,
    make_mesh,
)
from elastic.sharded.plan import copy_holders, hsdp_replicas
from elastic.sharded.reshard import reshard_heal
from elastic.sharded.step_agreement import world_agreement_hook
from elastic_errors import ConfigError
from torch_private import socket_inodes

if TYPE_CHECKING:
    from elastic.context import ElasticContext

__all__ = ["ShardedWay"]

logger = logging.getLogger(__name__)

_DEFAULT_GROUP_TIMEOUT = timedelta(seconds=60)


class ShardedWay:
    """The sharded model of :class:`~elastic.loop.ElasticLoop`."""

    ctx: ElasticContext | None
    step: int
    has_state: bool
    optimizer: Any
    scheduler: Any
    _inplace: Any
    _user_state: dict[str, Any]
    _sharded: ShardedTraining | None
    _copies: ShardCopies | None
    _heal_epoch: int
    _snapshot_agreed: bool

    def _setup_sharding(self, model: nn.Module, *, parallelize: Any, optimizer: Any,
                        scheduler: Any, replicate: int, redundancy: int,
                        snapshot_every: int | None, micro_batch_size: int | None) -> None:
        """Validates the sharded loop's arguments and prepares its model (built later)."""
        if redundancy not in (0, 1):
            raise ConfigError(f"redundancy ({redundancy}) must be 0 (storage only) or 1 (each "
                              "shard also in a peer's host memory, or in its HSDP replica).")
        if micro_batch_size == 1:
            raise ConfigError(
                "micro_batch_size (1) with parallelize= lets ranks with a smaller share run "
                "one forward fewer, which a sharded model's collectives cannot follow; use 2 "
                "or more."
            )
        controller = self._inplace
        self._sharded = ShardedTraining(
            model, parallelize=parallelize, optimizer=optimizer, scheduler=scheduler,
            replicate=replicate, on_optimizer=self._hook_optimizer)
        self._sharded.mesh_builder = self._build_mesh
        self._copies = (ShardCopies(every=snapshot_every)
                        if redundancy and controller is not None else None)
        if controller is not None and self._copies is not None:
            controller.before_drop.append(self._copies.settle)
        self._heal_epoch = 0
        self._snapshot_agreed = False

    def _sharded_state(self) -> dict[str, Any]:
        """The checkpointed entries the sharded model adds (``train``, ``scheduler``)."""
        assert self._sharded is not None
        state: dict[str, Any] = {"train": ShardedTrainState(self._sharded)}
        if self._sharded.scheduler_factory is not None:
            state["scheduler"] = CurrentScheduler(self._sharded)
        return state

    def _hook_optimizer(self, optimizer: Any) -> None:
        controller = self._inplace
        ctx = self.ctx
        if controller is not None and ctx is not None and self._sharded is not None and \
                hsdp_replicas(ctx.world_size, self._sharded.replicate) > 1:
            # HSDP: no survivor applies a step some other survivor did not (first: on NCCL
            # the host wait below covers it).
            optimizer.register_step_pre_hook(world_agreement_hook(
                group=lambda: ctx.process_group, device=lambda: ctx.device))
        if controller is not None:
            # NCCL: a step of an aborted world must never be applied (see the controller; a
            # sharded loop's steps are not gated on the device: the host waits for them).
            optimizer.register_step_pre_hook(
                lambda o, *_a: controller.before_optimizer_step(o, None))
            optimizer.register_step_post_hook(lambda o, *_a: controller.after_optimizer_step(o))
        copies = self._copies
        if copies is not None:
            # No rank's state moves past a refresh before its copies are whole everywhere.
            optimizer.register_step_pre_hook(lambda *_a: copies.confirm())

    def _build_mesh(self, device_type: str, world_size: int, replicate: int) -> DeviceMesh:
        """The world's mesh; in place, its groups are aborted with the world's."""
        controller = self._inplace
        if controller is None:
            return make_mesh(device_type, world_size, replicate)
        before = socket_inodes()
        mesh = make_mesh(device_type, world_size, replicate)
        controller.adopt_groups(before, *mesh.get_all_groups())
        return mesh

    def step_gate_blocker(self) -> str | None:
        """See :meth:`~elastic.loop.rewind.StepRewind.step_gate_blocker`: a sharded loop's
        optimizer is rebuilt on every world, so its steps are not gated on the device."""
        if self._sharded is not None:
            return "a sharded model's optimizer is rebuilt on every world"
        blocker: str | None = super().step_gate_blocker()  # type: ignore[misc]
        return blocker

    # -- the current world's model ----------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The current world's model (``parallelize``'s result): call it, clip its gradients,
        gather its weights. It is a new object on every world: do not keep it across steps."""
        if self._sharded is None:
            module = getattr(self, "_module", None)
            if module is None:
                raise ConfigError("loop.module needs model= (with parallelize= or the managed "
                                  "loop).")
            return module  # type: ignore[no-any-return]
        return self._sharded.require().module

    def _adopt(self, built: Built) -> None:
        self.optimizer = built.optimizer
        self.scheduler = built.scheduler

    def _build_alone(self) -> None:
        """Builds the first world's model outside in-place healing (restart mode, or a
        single process)."""
        assert self._sharded is not None
        if self._sharded.current is not None:
            return
        if self.ctx is None or not dist.is_initialized():
            raise ConfigError("parallelize= needs torch.distributed: call elastic.init() "
                              "and pass its context to ElasticLoop.")
        built = self._sharded.build(self.ctx.device, self.ctx.world_size)
        self._sharded.install(built)
        self._adopt(built)

    def _sharded_loaded(self, found: bool) -> None:
        """A storage restore finished (``found``: a checkpoint was loaded)."""
        assert self._sharded is not None
        built = self._sharded.require()
        if not found and not built.from_weights:
            raise ConfigError(
                "every holder of some shard is gone and no checkpoint is committed, so the "
                "model's state is lost; keep a checkpoint (checkpoint=) so that the job can "
                "restore it, or restart the job from the beginning."
            )
        if self._copies is not None:
            self._copies.discard_after(self.step)
        self._heal_epoch = self.ctx.generation if self.ctx is not None else 0

    # -- healing a new world ----------------------------------------------------------------

    def loop_small(self) -> dict[str, Any]:
        """The loop's own state and the user's other state, replicated on every rank."""
        user = {key: (value.state_dict() if hasattr(value, "state_dict") else value)
                for key, value in self._plain_user_state().items()}
        return {"loop": LoopState(self).state_dict(), "user": user}  # type: ignore[arg-type]

    def load_loop_small(self, small: dict[str, Any]) -> None:
        """Loads what :meth:`loop_small` returned."""
        LoopState(self).load_state_dict(small["loop"])  # type: ignore[arg-type]
        load_state(self._plain_user_state(), small["user"])

    def _plain_user_state(self) -> dict[str, Any]:
        return {key: value for key, value in self._user_state.items()
                if not isinstance(value, ShardedTrainState | CurrentScheduler)}

    def heal_sharded(self, controller: Any, spoiled: bool) -> HealResult:
        """The in-place controller's heal of a new world (see :mod:`elastic.sharded.reshard`).

        Args:
            controller: The in-place controller.
            spoiled: Whether this rank's live state cannot be trusted (NCCL step fence off).
        """
        assert self._sharded is not None and self.ctx is not None
        ctx = self.ctx
        if self._copies is not None:
            self._copies.settle()
        outcome = reshard_heal(
            training=self._sharded, copies=self._copies, loop=self,
            live_step=self.step if self.has_state and not spoiled else -1,
            heal_epoch=self._heal_epoch, group=ctx.checkpoint_group, device=ctx.device,
            world_size=ctx.world_size)
        self._adopt(outcome.built)
        if outcome.result.step >= 0:
            self._heal_epoch = ctx.generation
        self._configure_copies(controller, outcome.built)
        return outcome.result

    def _configure_copies(self, controller: Any, built: Built) -> None:
        copies = self._copies
        if copies is None or self.ctx is None:
            return
        ctx = self.ctx
        world = controller.world
        nodes = [m.node for m in world.members for _ in m.workers]
        replicas = hsdp_replicas(ctx.world_size, self._sharded.replicate) if self._sharded \
            else 1
        if replicas > 1 or ctx.world_size < 2:
            # HSDP: every shard lives in each replica group already.
            copies.configure(None, holder=-1, owner=-1, shards=built.shards,
                             index=built.index, local_workers=1)
            return
        holders = copy_holders(nodes)
        before = socket_inodes()
        timeout = controller.train_timeout or controller.build_timeout or \
            _DEFAULT_GROUP_TIMEOUT
        group = dist.new_group(backend="gloo", timeout=timeout)
        controller.adopt_groups(before, group)
        rank = ctx.rank
        mine = sum(1 for node in nodes if node == nodes[rank])
        copies.configure(group, holder=holders[rank], owner=holders.index(rank),
                         shards=built.shards, index=built.index, local_workers=mine)
        if rank == 0 and len(set(nodes)) > 1 and any(
                nodes[r] == nodes[holders[r]] for r in range(len(nodes))):
            logger.warning("some shard copies share their owner's node (%s): a node's loss "
                           "may need storage", sorted(set(nodes)))

    # -- snapshots ----------------------------------------------------------------------------

    def _snapshot_flag(self) -> bool:
        """This rank's vote *against* a refresh now (automatic cadence, agreed at a boundary:
        every rank must find it due, so the rank whose refreshes cost most sets the pace)."""
        copies = self._copies
        return copies is None or copies.every is not None or not copies.due(self.step)

    def _refresh_copies(self) -> None:
        """After a completed step: refreshes the snapshot when due (the same on every rank)."""
        copies, sharded = self._copies, self._sharded
        if copies is None or sharded is None or sharded.current is None:
            return
        if copies.every is not None:
            due = copies.due(self.step)
        else:
            due, self._snapshot_agreed = self._snapshot_agreed, False
        if not due:
            return
        built = sharded.current
        small = {**self.loop_small(), "model": ShardedTraining.small_state(built)}
        copies.take(self.step, built.locals(), small)
