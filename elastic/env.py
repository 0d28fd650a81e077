"""Names of every environment variable elastic-run reads or sets.

Kept in one module so that the launcher, the workers and the tests agree on spelling.
Precedence everywhere is: command-line flag, then environment variable, then default.
"""

from __future__ import annotations

from typing import Final

RUN_ID: Final = "ELASTIC_RUN_ID"
"""The job id (``--job-id``/``--rdzv-id``); namespaces every etcd key of the job."""

ROUND: Final = "ELASTIC_ROUND"
"""The rendezvous round the current workers were started in (set by the agent)."""

ETCD_ENDPOINTS: Final = "ELASTIC_ETCD_ENDPOINTS"
"""Comma-separated ``host:port`` list of etcd client endpoints (``--etcd``)."""

ETCD_BINARY: Final = "ELASTIC_ETCD_BINARY"
"""Path of the etcd binary used by ``--standalone`` and the tests."""

ETCD_USERNAME: Final = "ELASTIC_ETCD_USERNAME"
ETCD_PASSWORD: Final = "ELASTIC_ETCD_PASSWORD"
ETCD_CA_CERT: Final = "ELASTIC_ETCD_CA_CERT"
ETCD_CERT: Final = "ELASTIC_ETCD_CERT"
ETCD_KEY: Final = "ELASTIC_ETCD_KEY"

AGENT_PID: Final = "ELASTIC_AGENT_PID"
"""PID of the node agent that started this worker; workers exit if it dies."""

REQUIRE_ETCD: Final = "ELASTIC_REQUIRE_ETCD"
"""Tests only: when ``1``, a missing etcd binary fails the etcd tests instead of skipping them."""

LOG_JSON: Final = "ELASTIC_LOG_JSON"
"""When ``1``, structured event logs are written as JSON lines."""

PREEMPTION_WATCH: Final = "ELASTIC_PREEMPTION_WATCH"
"""Preemption-notice sources (``--preemption-watch``): ``auto``, ``none``, or ``aws,gcp,...``."""

AWS_METADATA_URL: Final = "ELASTIC_AWS_METADATA_URL"
"""Base URL of AWS IMDS (default ``http://169.254.169.254``); tests point it at a fake."""

GCP_METADATA_URL: Final = "ELASTIC_GCP_METADATA_URL"
"""Base URL of the GCP metadata server (default ``http://169.254.169.254``)."""

AZURE_METADATA_URL: Final = "ELASTIC_AZURE_METADATA_URL"
"""Base URL of Azure IMDS for Scheduled Events (default ``http://169.254.169.254``)."""

EVENTS_DIR: Final = "ELASTIC_EVENTS_DIR"
"""Directory of the job event log (``--events-dir``), read by ``elastic-run goodput``."""

EVENTS_COPY: Final = "ELASTIC_EVENTS_COPY"
"""Local directory where an agent also appends every record it logs (``--events-copy``)."""

MODE: Final = "ELASTIC_MODE"
"""How membership changes are handled (``--elastic-mode``): ``auto`` (the default: in place
for scripts that declare it with ``elastic.init(inplace=True)``, restart otherwise),
``inplace`` (survivors keep running and reconfigure, see :mod:`elastic.inplace`) or
``restart`` (every worker restarts)."""

KEY_PREFIX: Final = "ELASTIC_KEY_PREFIX"
"""elastic-run's etcd key prefix (``--rdzv-conf key_prefix``), passed to in-place workers."""

INPLACE_TTL: Final = "ELASTIC_INPLACE_TTL"
"""Seconds an in-place worker's member key outlives a lost node (``--inplace-ttl``)."""

INPLACE_BUILD_TIMEOUT: Final = "ELASTIC_INPLACE_BUILD_TIMEOUT"
"""Seconds building an in-place world's process groups waits for every member."""

INPLACE_MARKER: Final = "ELASTIC_INPLACE_MARKER"
"""A file an in-place worker creates once it joined a world: tells its agent, without a network
call, that the job's script runs in place (``--elastic-mode auto``)."""

AGENT_SOCKET: Final = "ELASTIC_AGENT_SOCKET"
"""The node agent's channel socket (a Unix socket in a directory only the agent's user can
enter); workers learn the world there and never talk to etcd themselves."""

INCARNATION: Final = "ELASTIC_INCARNATION"
"""Which start of its slot (local rank) a worker process is; with the node id it makes the
worker's id unique per incarnation."""

WORKER_ID: Final = "ELASTIC_WORKER_ID"
"""The worker's job-wide id, ``{node}/{local_rank}.{incarnation}``."""

START: Final = "ELASTIC_START"
"""How the agent started a worker: ``member`` (its world is known: RANK and WORLD_SIZE are
final) or ``joiner`` (it joins a running world in place and is admitted when its training
loop starts)."""

HANG_TIMEOUT: Final = "ELASTIC_HANG_TIMEOUT"
"""In place: the least time (seconds) a worker waits in a step's collective before it reports
that it waits for a peer (the progress rule; ``--hang-timeout``)."""

HANG_FACTOR: Final = "ELASTIC_HANG_FACTOR"
"""In place: the hang threshold is at least this many median step times (``--hang-factor``)."""
TELEMETRY_SOCKET: Final = "ELASTIC_TELEMETRY_SOCKET"
"""Path of the node agent's Unix datagram socket (set by the agent for its workers): a worker's
event log sends its records there, without blocking, instead of writing them itself
(:mod:`elastic.telemetry`)."""

METRICS_PORT: Final = "ELASTIC_METRICS_PORT"
"""Port of the agent's Prometheus endpoint ``/metrics`` (``--metrics-port``; off when unset)."""

METRICS_HOST: Final = "ELASTIC_METRICS_HOST"
"""Address the agent's Prometheus endpoint binds (``--metrics-host``; default every interface)."""

WARM_STANDBY: Final = "ELASTIC_WARM_STANDBY"
"""``on`` (default) or ``off``: whether the agent keeps a warm standby interpreter per worker
slot, torch imported, to start restarted workers in (``--warm-standby``;
:mod:`launch.standby`)."""

STANDBY_PRELOAD: Final = "ELASTIC_STANDBY_PRELOAD"
"""Comma-separated modules a warm standby imports while it waits (default: torch and the torch
modules nearly every training script imports; empty: none). None may initialise CUDA."""

STANDBY_FD: Final = "ELASTIC_STANDBY_FD"
"""Set by the agent for a warm standby only: the file descriptor of its link to the agent."""

MEMORY_STORE: Final = "ELASTIC_MEMORY_STORE"
"""Set by the agent for its workers: ``host:port`` of the node's checkpoint memory store, where
``CheckpointManager`` keeps copies of each committed save and restores from
(:mod:`checkpointing.memory_tier`; ``--memory-checkpoints``)."""

MEMORY_CHECKPOINTS: Final = "ELASTIC_MEMORY_CHECKPOINTS"
"""``on`` (default) or ``off``: whether the agent keeps its workers' committed checkpoints in
host memory for restores (``--memory-checkpoints``)."""
