"""The etcd v3 rendezvous backend for torch's dynamic rendezvous, and its torchrun entry point.

etcd keyspace of a job (``key_prefix`` defaults to ``/elastic``)::

    {key_prefix}/{run_id}/rdzv/state                torch's pickled rendezvous state in a
                                                    magic+version envelope (``ELRDZV1\\0``);
                                                    written only by compare-and-swap on its mod
                                                    revision (the fencing token), under the
                                                    writer's long lease (``state_ttl``)
    {key_prefix}/{run_id}/store/{key}               EtcdV3Store keys (torch adds a per-round
                                                    PrefixStore: rank assignment, exit barrier)
    {key_prefix}/{run_id}/members/{round}/{rank}    JSON MemberInfo of a node in a round, on the
                                                    node's short lease (``member_ttl``): it
                                                    vanishes within a TTL of the node's death

Write access to this keyspace means code execution on every agent (the state is a pickle):
production etcd needs TLS client certificates or user/password auth, and a network policy.

This module is the target of the ``torchrun.handlers`` entry points ``etcd-v3`` and
``elastic-etcd-v3``. torch loads it while ``torch.distributed.elastic.rendezvous`` is being
imported, so it imports nothing heavy at module level and :func:`torchrun_handler` never raises;
the backend class lives in a private module and is imported on first use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from elastic._rdzv_backend import EtcdV3RendezvousBackend
    from elastic.etcd import EtcdClient

__all__ = [
    "DEFAULTS",
    "STATE_MAGIC",
    "EtcdV3RendezvousBackend",
    "create_client",
    "create_rdzv_handler",
    "torchrun_handler",
]

logger = logging.getLogger(__name__)

STATE_MAGIC: Final = b"ELRDZV1\0"
"""Envelope of the state value: a magic string with the format version, then torch's pickle."""

DEFAULTS: Final[dict[str, float]] = {
    "join_timeout": 600.0,
    "last_call_timeout": 2.0,
    "close_timeout": 10.0,
    "heartbeat_timeout": 5.0,
    "keep_alive_interval": 1.0,
    "keep_alive_max_attempt": 3.0,
    "read_timeout": 5.0,
    "deadline": 30.0,
    "member_ttl": 3.0,
    "state_ttl": 7200.0,
}
"""Numeric ``--rdzv-conf`` keys and their defaults (seconds, or a count)."""

_ZERO_ALLOWED: Final = frozenset({"state_ttl"})
_STRING_KEYS: Final = frozenset({"key_prefix", "protocol", "ca_cert", "ssl_cert", "ssl_cert_key"})
# Keys torch's own launcher puts into the rendezvous config for every backend.
_TORCH_KEYS: Final = frozenset({"timeout", "is_host", "rank", "use_libuv", "local_addr"})


def __getattr__(name: str) -> Any:
    # The backend class imports torch's dynamic rendezvous; load it only when asked for.
    if name == "EtcdV3RendezvousBackend":
        from elastic._rdzv_backend import EtcdV3RendezvousBackend

        return EtcdV3RendezvousBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _number(params: RendezvousParameters, key: str, *, allow_zero: bool = False) -> float:
    from elastic.errors import ConfigError

    raw = params.config.get(key, DEFAULTS[key])
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(
            f"--rdzv-conf {key} ({raw!r}) must be a positive number; pass e.g. "
            f"{key}={DEFAULTS[key]:g}."
        )
    return value


HEARTBEAT_WRITES_PER_S: Final = 32
"""Heartbeat writes per second a job may put on the one state key by default (see below)."""


def keep_alive_interval(params: RendezvousParameters) -> int:
    """The heartbeat period: ``--rdzv-conf keep_alive_interval``, else scaled with max nodes.

    Every torch heartbeat rewrites the whole rendezvous state (one Raft commit and fsync), so
    N nodes beating every second ask N writes per second of etcd, on top of their joins; on a
    slow disk that starves the round (rendezvous_scale.py: 128 agents never completed at
    1 s). By default the period grows so that the whole job stays near
    ``HEARTBEAT_WRITES_PER_S``: 1 s up to 32 nodes, 4 s at 128. Lost nodes are still noticed
    within ``member_ttl`` through their member leases; the period only bounds how long a node
    that dies while a round is forming stays in it.
    """
    if "keep_alive_interval" in params.config:
        return max(1, round(_number(params, "keep_alive_interval")))
    return max(1, -(-params.max_nodes // HEARTBEAT_WRITES_PER_S))


def _warn_unknown_keys(params: RendezvousParameters) -> None:
    unknown = sorted(set(params.config) - set(DEFAULTS) - _STRING_KEYS - _TORCH_KEYS)
    if unknown:
        logger.warning("Ignoring unknown --rdzv-conf key(s) %s of the %s backend.", unknown,
                       params.backend)


def create_client(params: RendezvousParameters) -> EtcdClient:
    """Builds the etcd client a rendezvous handler uses from torchrun's parameters.

    The endpoint list is ``params.endpoint`` or ``$ELASTIC_ETCD_ENDPOINTS``; TLS files come
    from ``--rdzv-conf`` or ``ELASTIC_ETCD_{CA_CERT,CERT,KEY}``; credentials only from
    ``ELASTIC_ETCD_USERNAME``/``ELASTIC_ETCD_PASSWORD`` (never the command line, which every
    local user can read).

    Raises:
        ConfigError: for a missing or unparsable endpoint or a bad numeric key.
    """
    from elastic import env
    from elastic.errors import ConfigError
    from elastic.etcd import EtcdClient, config_from_env

    endpoint = params.endpoint or os.environ.get(env.ETCD_ENDPOINTS, "")
    if not endpoint:
        raise ConfigError(
            f"no etcd endpoint given; pass --rdzv-endpoint host:port or set {env.ETCD_ENDPOINTS}."
        )
    return EtcdClient(config_from_env(
        endpoint,
        protocol=params.config.get("protocol") or None,
        ca_cert=params.config.get("ca_cert") or None,
        cert=params.config.get("ssl_cert") or None,
        key=params.config.get("ssl_cert_key") or None,
        request_timeout=timedelta(seconds=_number(params, "read_timeout")),
        deadline=timedelta(seconds=_number(params, "deadline")),
    ))


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Creates torch's dynamic rendezvous handler over etcd, with lease-based membership.

    The defaults suit spot clusters of up to a few dozen nodes: a lost node is noticed within
    about ``member_ttl`` and a new round forms a few seconds later. The heartbeat period grows
    with ``max_nodes`` (every heartbeat rewrites the one state key; see
    :func:`keep_alive_interval` and ``benchmarks/rendezvous_scale.py``).

    ``--rdzv-conf`` keys (times in seconds):

    ======================  ========  ===================================================
    key                     default   meaning
    ======================  ========  ===================================================
    join_timeout            600       time a round may take to complete
    last_call_timeout       2         wait for more nodes once ``min_nodes`` are present
    close_timeout           10        time to close the rendezvous on shutdown
    heartbeat_timeout       5         time one heartbeat write may take
    keep_alive_interval     1 (*)     heartbeat period (whole seconds, at least 1);
                                      (*) max_nodes / 32 rounded up when not given
    keep_alive_max_attempt  3         missed heartbeats before torch drops a node
    member_ttl              3         lease TTL of a node's member key: the others see a
                                      dead node within about this long (whole seconds)
    state_ttl               7200      the state key outlives the job's last agent this
                                      long (0: forever)
    read_timeout            5         one etcd request
    deadline                30        retrying etcd before the job fails, naming the
                                      endpoints
    key_prefix              /elastic  prefix of every key of elastic-run
    protocol                http      ``https`` for TLS (default when a CA is given)
    ca_cert                 (none)    CA bundle (or ``ELASTIC_ETCD_CA_CERT``)
    ssl_cert                (none)    client certificate (or ``ELASTIC_ETCD_CERT``)
    ssl_cert_key            (none)    client key (or ``ELASTIC_ETCD_KEY``)
    ======================  ========  ===================================================

    Args:
        params: torch's rendezvous parameters (``backend`` is the name this handler
            reports, so aliases pass torch's registry check).

    Returns:
        An :class:`~elastic.handler.ElasticRendezvousHandler`.

    Raises:
        ConfigError: for a bad ``--rdzv-conf`` value or endpoint.
        RendezvousConnectionError: when etcd is unreachable within the deadline.
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    from elastic._rdzv_backend import EtcdV3RendezvousBackend
    from elastic.errors import EtcdUnavailableError
    from elastic.handler import ElasticRendezvousHandler
    from elastic.membership import MembershipRegistry
    from elastic.store import EtcdV3Store

    # torch's agent otherwise reuses the rank-0 agent's TCPStore for the workers across rounds,
    # and new workers can read a dead worker's address from it (pytorch#135712: restarts hang).
    # Each round's rank-0 worker hosts a fresh store instead. Set here so plain torchrun with
    # this backend gets the fix too; it is read by torch's handler in this (the agent) process.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    _warn_unknown_keys(params)
    for key in DEFAULTS:  # every bad value is reported before anything touches the network
        _number(params, key, allow_zero=key in _ZERO_ALLOWED)
    client = create_client(params)
    key_prefix = str(params.config.get("key_prefix", "/elastic"))
    backend = EtcdV3RendezvousBackend(
        client, params.run_id, key_prefix=key_prefix, name=params.backend,
        state_ttl=round(_number(params, "state_ttl", allow_zero=True)),
    )
    store = EtcdV3Store(client, f"{key_prefix.rstrip('/')}/{params.run_id}/store/")
    registry = MembershipRegistry(
        client, params.run_id, key_prefix=key_prefix,
        member_ttl=max(1, round(_number(params, "member_ttl"))),
    )
    try:
        client.get(backend.key)  # fail fast, naming the endpoints, if etcd is unreachable
    except EtcdUnavailableError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    inner = DynamicRendezvousHandler.from_backend(
        run_id=params.run_id,
        store=store,
        backend=backend,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        timeout=RendezvousTimeout(
            join=timedelta(seconds=_number(params, "join_timeout")),
            last_call=timedelta(seconds=_number(params, "last_call_timeout")),
            close=timedelta(seconds=_number(params, "close_timeout")),
            heartbeat=timedelta(seconds=_number(params, "heartbeat_timeout")),
        ),
        keep_alive_interval=keep_alive_interval(params),
        keep_alive_max_attempt=max(1, round(_number(params, "keep_alive_max_attempt"))),
    )
    return ElasticRendezvousHandler(inner, registry, backend=backend)


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the handler creator (never raises)."""
    return create_rdzv_handler
