"""The world a framework-driven worker runs in, and the one decision every rank must share.

elastic-run (and torchrun) start each worker with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` set; a script started by plain
``python`` is a world of one. The frameworks build the default process group themselves, but
only once their ``fit``/``train`` runs, and by then they have already been told which
checkpoint to load. Every rank must load the same one, and a previous world's rank 0 may
still be committing one while this world's workers start, so the choice is made by rank 0
and broadcast: :func:`join_default_group` builds the default group early (the frameworks
keep a group that exists), and :func:`agree` shares rank 0's answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from elastic_errors import ConfigError

__all__ = ["WorkerWorld", "agree", "join_default_group", "world_from_env"]

_T = TypeVar("_T")

#: How long building the group and each collective may take: workers of a world start
#: seconds apart (imports), and a hung peer is the agent's to stop (it restarts the world).
GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class WorkerWorld:
    """This worker's place: its global and local rank, and the sizes around it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    #: Whether a launcher (elastic-run, torchrun) started this worker.
    launched: bool
    #: The rendezvous round under elastic-run (``ELASTIC_ROUND``), else ``None``.
    round: int | None


def _number(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{name} ({raw!r}) must be an integer; start the script with elastic-run or "
            "torchrun, which set it."
        ) from None


def world_from_env() -> WorkerWorld:
    """The world the launcher started this worker in (a world of one without a launcher).

    Raises:
        ConfigError: If a launcher variable is malformed or the ranks are inconsistent.
    """
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = _number("WORLD_SIZE", 1)
    rank = _number("RANK", 0)
    local_rank = _number("LOCAL_RANK", 0)
    local_world = _number("LOCAL_WORLD_SIZE", world_size if launched else 1)
    if not 0 <= rank < world_size or not 0 <= local_rank < max(1, local_world):
        raise ConfigError(
            f"RANK ({rank}) and LOCAL_RANK ({local_rank}) must be below WORLD_SIZE "
            f"({world_size}) and LOCAL_WORLD_SIZE ({local_world}); start the script with "
            "elastic-run or torchrun."
        )
    raw_round = os.environ.get("ELASTIC_ROUND", "")
    return WorkerWorld(rank=rank, world_size=world_size, local_rank=local_rank,
                       local_world_size=local_world, launched=launched,
                       round=int(raw_round) if raw_round.isdigit() else None)


def join_default_group(world: WorkerWorld, *, backend: str | None = None,
                       timeout: timedelta = GROUP_TIMEOUT) -> None:
    """Builds the default process group from the launcher's ``env://`` variables, unless it
    exists or the world is one worker (the frameworks then keep it as it is).

    Args:
        world: This worker's world.
        backend: ``nccl`` or ``gloo``; ``None``: NCCL when CUDA is available, else gloo.
        timeout: Timeout of building the group and of its collectives.
    """
    if not world.launched or dist.is_initialized():
        return
    device_id = None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device_id = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, rank=world.rank, world_size=world.world_size,
                            timeout=timeout, device_id=device_id)


def agree(value: _T) -> _T:
    """Rank 0's ``value`` on every rank (``value`` itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box: list[object] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]
