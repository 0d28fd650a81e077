"""What the node agent is told (:class:`AgentConfig`) and how its part of a job ends
(:class:`AgentOutcome`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from launch.budget import CrashBudget

__all__ = ["AgentConfig", "AgentOutcome"]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything the agent needs from the command line.

    Attributes:
        job_id: The job id.
        key_prefix: elastic-run's etcd key prefix.
        min_nodes: Fewest nodes a world trains with.
        max_nodes: Most nodes a world takes.
        nproc_per_node: Worker slots on this node.
        addr: The address peers dial to reach this node.
        ttl: Node lease TTL, and a worker's heartbeat timeout, in seconds.
        last_call: Seconds joins settle before a world grows.
        join_timeout: Seconds this node may wait without a world before it gives up.
        monitor_interval: Seconds between two looks at the workers.
        budget: The node's crash budget.
        mode: ``auto``, ``inplace`` or ``restart`` (``--elastic-mode``).
        shutdown_grace: Seconds between SIGTERM and SIGKILL when stopping workers.
        drain_timeout: On a preemption notice, the longest the workers get to leave.
        linger: Seconds after a run's end during which a node that comes late exits instead
            of starting a fresh run of the job id (0: never).
        worker_env: Extra environment for every worker (in-place tuning, events, ...).
        metrics_port: The agent's Prometheus port, published in the node record.
        build_timeout: Seconds a world's process groups wait for every member
            (``--inplace-build-timeout``); after a failed build the leader waits at most this
            long for the other members' builds to fail too before writing the world again.
        warm_standby: Keep a warm standby interpreter per slot to start workers in
            (``--warm-standby``, :mod:`launch.standby`).
        standby_in_place: Keep the standbys once this node's workers declared that they
            reconfigure in place too (``--warm-standby on``); otherwise (``auto``) they are
            dropped then.
    """

    job_id: str
    key_prefix: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    addr: str
    ttl: int = 3
    last_call: float = 1.0
    join_timeout: float = 600.0
    monitor_interval: float = 0.1
    budget: CrashBudget = field(default_factory=CrashBudget)
    mode: str = "auto"
    shutdown_grace: float = 30.0
    drain_timeout: float = 60.0
    linger: int = 0
    worker_env: Mapping[str, str] = field(default_factory=dict)
    metrics_port: int | None = None
    build_timeout: float = 10.0
    warm_standby: bool = False
    standby_in_place: bool = False


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """How this node's part of the job ended.

    Attributes:
        code: The process exit code.
        outcome: ``succeeded``, ``failed``, ``departed``, ``already_finished``, ...
        message: One sentence for the user (the last line of the output when it failed).
    """

    code: int
    outcome: str
    message: str
