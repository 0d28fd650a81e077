"""``elastic.init()``: one call that turns torchrun's environment into a ready worker.

Forward compatibility with in-place reconfiguration (issue 5): the world a worker belongs to
may change while the process lives. :class:`ElasticContext` therefore exposes the *current*
world through read-only properties (read them when needed instead of caching them) plus a
``generation`` counter that increases on every change; :class:`~elastic.loop.ElasticLoop`
re-plans batches and re-shards the sampler whenever it sees a new generation. In the
restart-based path the generation is always 0, because every change starts new processes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic import env
from elastic.process_group import (
    ProcessGroups,
    destroy_process_groups,
    lower_timeouts,
)
from elastic_errors import ConfigError

__all__ = ["ElasticContext", "World"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class World:
    """One membership of the job, as torchrun's agent and elastic-run describe it.

    Attributes:
        rank: Global rank of this worker.
        world_size: Number of workers.
        local_rank: Rank on this node.
        local_world_size: Workers on this node.
        group_rank: Rank of this node.
        round: elastic-run's rendezvous round (0 outside elastic-run).
        restart_count: ``TORCHELASTIC_RESTART_COUNT``.
        run_id: The job id.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    round: int
    restart_count: int
    run_id: str

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank ({self.rank}) must be in [0, world size ({self.world_size})); start "
                "the script with elastic-run or torchrun, which set RANK and WORLD_SIZE."
            )

    @classmethod
    def from_env(cls) -> World:
        """Reads the variables torchrun's agent and elastic-run set for each worker."""

        def number(name: str, default: int) -> int:
            raw = os.environ.get(name, str(default))
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(
                    f"environment variable {name} ({raw!r}) must be an integer; start the "
                    "script with elastic-run or torchrun."
                ) from None

        world_size = number("WORLD_SIZE", 1)
        return cls(
            rank=number("RANK", 0),
            world_size=world_size,
            local_rank=number("LOCAL_RANK", 0),
            local_world_size=number("LOCAL_WORLD_SIZE", world_size),
            group_rank=number("GROUP_RANK", 0),
            round=number(env.ROUND, 0),
            restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
            run_id=os.environ.get(env.RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID", "none"),
        )


class ElasticContext:
    """A worker's place in the job: world, device and process groups.

    Built by :func:`init`. Every property reflects the current world (see the module
    docstring); ``generation`` counts changes of it inside this process.
    """

    _world: World
    _groups: ProcessGroups
    _device: torch.device
    _train_timeout: timedelta | None
    _timeouts_lowered: bool
    _closed: bool
    generation: int
    inplace: Any

    def __init__(
        self,
        world: World,
        groups: ProcessGroups,
        device: torch.device,
        *,
        train_timeout: timedelta | None,
    ) -> None:
        self._world = world
        self._groups = groups
        self._device = device
        self._train_timeout = train_timeout
        self._timeouts_lowered = False
        self._closed = False
        self.generation = 0
        #: The in-place controller (:mod:`elastic.inplace`) when the job runs in place.
        self.inplace: Any = None

    def _replace_world(self, world: World, groups: ProcessGroups, *, generation: int) -> None:
        """Switches to a new world in this process (in-place reconfiguration only)."""
        self._world = world
        self._groups = groups
        self.generation = generation

    @property
    def world(self) -> World:
        """The current membership."""
        return self._world

    @property
    def rank(self) -> int:
        """Global rank of this worker."""
        return self._world.rank

    @property
    def world_size(self) -> int:
        """Number of workers (data-parallel ranks)."""
        return self._world.world_size

    @property
    def local_rank(self) -> int:
        """Rank on this node."""
        return self._world.local_rank

    @property
    def round(self) -> int:
        """elastic-run's rendezvous round."""
        return self._world.round

    @property
    def is_leader(self) -> bool:
        """True on global rank 0 (print, log metrics there)."""
        return self._world.rank == 0

    @property
    def device(self) -> torch.device:
        """``cuda:<local_rank>`` under NCCL, else CPU."""
        return self._device

    @property
    def backend(self) -> str:
        """Backend of the training group."""
        return self._groups.backend

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The training (default) process group."""
        return self._groups.default

    @property
    def checkpoint_group(self) -> dist.ProcessGroup:
        """The gloo group for checkpoint collectives (pass it to ``CheckpointManager``)."""
        return self._groups.checkpoint

    def after_first_step(self) -> None:
        """Lowers the training timeout once every rank has run a step (idempotent)."""
        if self._timeouts_lowered or self._train_timeout is None or self._closed:
            return
        self._timeouts_lowered = True
        lower_timeouts(self._groups, self._train_timeout)

    def close(self) -> None:
        """Destroys the process groups; also runs at interpreter exit. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.inplace is not None:
            from elastic.inplace.groups import abort_groups

            abort_groups()  # a broken group must not hang the interpreter's exit
            return
        destroy_process_groups()

    def __repr__(self) -> str:
        w = self._world
        return (
            f"ElasticContext(rank={w.rank}, world_size={w.world_size}, round={w.round}, "
            f"backend={self.backend!r}, device={self._device})"
        )
