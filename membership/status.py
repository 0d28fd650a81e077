"""A job's membership as an operator sees it (``elastic-run status``), read from etcd."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from elastic.contract.records import (
    EndRecord,
    GenerationRecord,
    NodeRecord,
    RecordError,
    WorldRecord,
    parse_nodes,
)
from membership.etcd import EtcdClient
from membership.keys import JobKeys

__all__ = ["JobStatus", "MemberStatus", "read_job_status"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MemberStatus:
    """One live node of the job."""

    node_id: str
    host: str
    addr: str
    pid: int
    """The node agent's process id."""
    group_rank: int
    """The node's rank in the current world (``-1``: waiting, not in it)."""
    workers: int
    """Worker slots of the node."""
    ready: int
    """Slots ready to train."""
    restarts: int
    """Worker crashes so far."""
    metrics_port: int | None = None
    departing: bool = False


@dataclass(frozen=True, slots=True)
class JobStatus:
    """The current run of a job id."""

    round: int
    """The current world's epoch (rounds and in-place reconfigurations are one sequence)."""
    world_size: int
    """Workers of the current world."""
    members: list[MemberStatus]
    """The live nodes, by rank in the world, then waiting ones."""
    generation: int = 1
    """Which run of the job id this is."""
    mode: str = "restart"
    """``inplace`` or ``restart``."""
    ended: str | None = None
    """How the run ended, when it has."""
    expected_size: int = field(default=0)
    """Nodes of the current world (more than the live members while a loss is pending)."""


def read_job_status(client: EtcdClient, job_id: str, *,
                    key_prefix: str = "/elastic") -> JobStatus | None:
    """Reads the current run of ``job_id``; ``None`` when the job has never run.

    Raises:
        EtcdUnavailableError: When etcd cannot be reached within the deadline.
    """
    keys = JobKeys(key_prefix, job_id)
    kv = client.get(keys.generation_key)
    if kv is None:
        return None
    try:
        generation = GenerationRecord.loads(kv.value, kv.key)
    except RecordError as exc:
        logger.warning("%s", exc)
        return None
    run = keys.for_generation(generation.generation)
    items = {k.key: k for k in client.get_prefix(run.root)}
    world: WorldRecord | None = None
    if (raw := items.get(run.world)) is not None:
        try:
            world = WorldRecord.loads(raw.value, raw.key)
        except RecordError as exc:
            logger.warning("%s", exc)
    ended = None
    if (raw := items.get(run.end)) is not None:
        try:
            end = EndRecord.loads(raw.value, raw.key)
            ended = f"{end.outcome}: {end.reason}"
        except RecordError:
            ended = "unreadable end record"
    elif generation.state != "running":
        ended = generation.state
    nodes: list[NodeRecord] = parse_nodes(
        [(k.key, k.value, k.create_revision) for key, k in items.items()
         if key.startswith(run.nodes)], on_error=lambda exc: logger.warning("%s", exc))
    members = [
        MemberStatus(node_id=n.node, host=n.host, addr=n.addr, pid=n.agent_pid,
                     group_rank=world.node_rank(n.node) if world else -1,
                     workers=len(n.workers), ready=len(n.ready_workers()),
                     restarts=n.restarts, metrics_port=n.metrics_port,
                     departing=n.departing is not None)
        for n in nodes
    ]
    members.sort(key=lambda m: (m.group_rank < 0, m.group_rank, m.node_id))
    return JobStatus(round=world.epoch if world else 0,
                     world_size=world.world_size if world else 0, members=members,
                     generation=generation.generation,
                     mode=world.mode if world else "restart", ended=ended,
                     expected_size=len(world.members) if world else 0)
