"""The environment elastic-run gives each worker: torchrun's variables and its own."""

from __future__ import annotations

import os

from elastic import env
from elastic.contract.records import WorldRecord, worker_id
from launch.agent_config import AgentConfig
from launch.slot_state import Slot

__all__ = ["worker_env"]


def worker_env(config: AgentConfig, slot: Slot, *, node: str, channel_path: str,
               world: WorldRecord | None, running: WorldRecord | None) -> dict[str, str]:
    """The environment of ``slot``'s next worker, on top of the agent's own.

    Args:
        config: The agent's settings.
        slot: The slot (its local rank and incarnation).
        node: This node's id.
        channel_path: The agent's channel socket.
        world: The world the worker is started for, or ``None`` for a joiner of ``running``
            (which gets provisional ranks until it is admitted).
        running: The newest world.
    """
    values = {
        "LOCAL_RANK": str(slot.local_rank),
        "TORCHELASTIC_RUN_ID": config.job_id,
        "TORCHELASTIC_MAX_RESTARTS": str(config.budget.max_restarts),
        "TORCHELASTIC_RESTART_COUNT": str(config.budget.total),
        env.RUN_ID: config.job_id,
        env.AGENT_PID: str(os.getpid()),
        env.AGENT_SOCKET: channel_path,
        env.INCARNATION: str(slot.incarnation),
        env.WORKER_ID: worker_id(node, slot.local_id),
        env.MODE: config.mode,
        **config.worker_env,
    }
    if config.nproc_per_node > 1:
        values.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    if world is not None and (mine := world.member(node)) is not None:
        offset = world.rank_offset(node)
        position = mine.workers.index(slot.local_id)
        values.update({
            "RANK": str(offset + position), "WORLD_SIZE": str(world.world_size),
            "LOCAL_WORLD_SIZE": str(len(mine.workers)),
            "GROUP_RANK": str(world.node_rank(node)),
            "GROUP_WORLD_SIZE": str(len(world.members)),
            "ROLE_RANK": str(offset + position), "ROLE_WORLD_SIZE": str(world.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": world.store[0], "MASTER_PORT": str(world.store[1]),
            # The world's store is a fresh server hosted by an agent: every rank is a
            # client (torch's env:// rendezvous then adds no prefix, and none is needed).
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            env.ROUND: str(world.epoch), env.START: "member",
        })
    else:
        # A joiner of a running world: provisional values until it is admitted.
        size = running.world_size if running is not None else 1
        values.update({
            "RANK": str(max(0, size - 1)), "WORLD_SIZE": str(max(1, size)),
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            env.ROUND: str(running.epoch if running is not None else 0),
            env.START: "joiner",
        })
    return values
