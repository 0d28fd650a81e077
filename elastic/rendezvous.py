"""The etcd v3 rendezvous backend for torch's dynamic rendezvous, and its torchrun entry point.

etcd keyspace of a job (``key_prefix`` defaults to ``/elastic``)::

    {key_prefix}/{run_id}/rdzv/state    torch's pickled rendezvous state in a magic+version
                                         envelope; written only by compare-and-swap on its
                                         mod revision (the fencing token)
    {key_prefix}/{run_id}/store/...     EtcdV3Store keys (rank assignment, exit barrier)

This module is the target of the ``torchrun.handlers`` entry points ``etcd-v3`` and
``elastic-etcd-v3``. torch loads it while ``torch.distributed.elastic.rendezvous`` is being
imported, so it imports nothing heavy at module level and :func:`torchrun_handler` never raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from elastic.etcd import EtcdClient

STATE_MAGIC: Final = b"ELRDZV1\0"

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
}


def _backend_class() -> type[Any]:
    from torch.distributed.elastic.rendezvous import RendezvousStateError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

    class EtcdV3RendezvousBackend(RendezvousBackend):
        """Holds torch's rendezvous state in one etcd key, written by compare-and-swap.

        The fencing token is the key's mod revision: a write succeeds only if nobody wrote
        since the caller read, and a lost race returns the current state in the same round
        trip, as the ``RendezvousBackend`` contract asks.

        Args:
            client: the etcd client.
            run_id: the job id.
            key_prefix: prefix of every key of elastic-run.
            name: the backend name torch's registry knows this backend by.
        """

        def __init__(
            self, client: EtcdClient, run_id: str, *, key_prefix: str = "/elastic",
            name: str = "etcd-v3",
        ) -> None:
            if not run_id:
                from elastic.errors import ConfigError

                raise ConfigError("the job id is empty; pass --job-id (or --rdzv-id).")
            self._client = client
            self._name = name
            self.key = f"{key_prefix.rstrip('/')}/{run_id}/rdzv/state"

        @property
        def name(self) -> str:
            """See base class."""
            return self._name

        def _decode(self, raw: bytes) -> bytes:
            if not raw.startswith(STATE_MAGIC):
                raise RendezvousStateError(
                    f"The rendezvous state under etcd key {self.key} is corrupt (it does not "
                    f"start with {STATE_MAGIC!r}); delete the key or use a new --job-id."
                )
            return raw[len(STATE_MAGIC):]

        def get_state(self) -> tuple[bytes, Any] | None:
            """See base class."""
            current = self._client.get(self.key)
            if current is None:
                return None
            return self._decode(current.value), current.mod_revision

        def set_state(
            self, state: bytes, token: Any | None = None
        ) -> tuple[bytes, Any, bool] | None:
            """See base class."""
            if token is not None and not isinstance(token, int):
                current = self._client.get(self.key)  # an invalid token never writes
                if current is None:
                    return None
                return self._decode(current.value), current.mod_revision, False
            written, current = self._client.cas(self.key, STATE_MAGIC + state, token)
            if current is None:
                return None
            return self._decode(current.value), current.mod_revision, written

    return EtcdV3RendezvousBackend


def _float(params: RendezvousParameters, key: str) -> float:
    from elastic.errors import ConfigError

    raw = params.config.get(key, DEFAULTS[key])
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if value <= 0:
        raise ConfigError(
            f"--rdzv-conf {key} ({raw!r}) must be a positive number of seconds."
        )
    return value


def create_client(params: RendezvousParameters) -> EtcdClient:
    """Builds the etcd client a rendezvous handler uses from torchrun's parameters."""
    from elastic import env
    from elastic.etcd import EtcdClient, EtcdConfig, parse_endpoints

    endpoint = params.endpoint or os.environ.get(env.ETCD_ENDPOINTS, "")
    return EtcdClient(EtcdConfig(
        endpoints=parse_endpoints(endpoint),
        protocol=str(params.config.get("protocol", "http")),
        request_timeout=timedelta(seconds=_float(params, "read_timeout")),
        deadline=timedelta(seconds=_float(params, "deadline")),
        ca_cert=params.config.get("ca_cert") or os.environ.get(env.ETCD_CA_CERT),
        cert=params.config.get("ssl_cert") or os.environ.get(env.ETCD_CERT),
        key=params.config.get("ssl_cert_key") or os.environ.get(env.ETCD_KEY),
        username=os.environ.get(env.ETCD_USERNAME),
        password=os.environ.get(env.ETCD_PASSWORD),
    ))


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Creates torch's dynamic rendezvous handler over etcd.

    ``--rdzv-conf`` keys (seconds):

    ======================  =======  ==================================================
    key                     default  meaning
    ======================  =======  ==================================================
    join_timeout            600      time a round may take to complete
    last_call_timeout       2        wait for more nodes once ``min_nodes`` are present
    close_timeout           10       time to close the rendezvous on shutdown
    heartbeat_timeout       5        a node silent this long is dropped
    keep_alive_interval     1        heartbeat period
    keep_alive_max_attempt  3        missed heartbeats before a node is dropped
    read_timeout            5        one etcd request
    deadline                30       retrying etcd before the job fails
    member_ttl              3        lease TTL of a node's member key: a dead node is
                                     seen by the others within about this long
    key_prefix              /elastic prefix of every key
    protocol                http     ``https`` for TLS (``ca_cert``, ``ssl_cert``,
                                     ``ssl_cert_key`` keys or ``ELASTIC_ETCD_*`` env)
    ======================  =======  ==================================================
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    from elastic.errors import EtcdUnavailableError
    from elastic.handler import ElasticRendezvousHandler
    from elastic.membership import MembershipRegistry
    from elastic.store import EtcdV3Store

    # torch's agent otherwise reuses the rank-0 agent's TCPStore for the workers across rounds,
    # and new workers can read a dead worker's address from it (pytorch#135712: restarts hang).
    # Each round's rank-0 worker hosts a fresh store instead. Set here so plain torchrun with
    # this backend gets the fix too; it is read by torch's handler in this (the agent) process.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")

    client = create_client(params)
    key_prefix = str(params.config.get("key_prefix", "/elastic"))
    backend = _backend_class()(client, params.run_id, key_prefix=key_prefix, name=params.backend)
    store = EtcdV3Store(client, f"{key_prefix.rstrip('/')}/{params.run_id}/store/")
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
            join=timedelta(seconds=_float(params, "join_timeout")),
            last_call=timedelta(seconds=_float(params, "last_call_timeout")),
            close=timedelta(seconds=_float(params, "close_timeout")),
            heartbeat=timedelta(seconds=_float(params, "heartbeat_timeout")),
        ),
        keep_alive_interval=int(max(1.0, _float(params, "keep_alive_interval"))),
        keep_alive_max_attempt=int(_float(params, "keep_alive_max_attempt")),
    )
    registry = MembershipRegistry(client, params.run_id, key_prefix=key_prefix,
                                  member_ttl=max(1, round(_float(params, "member_ttl"))))
    return ElasticRendezvousHandler(inner, registry)


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the handler creator (never raises)."""
    return create_rdzv_handler


def EtcdV3RendezvousBackend(*args: Any, **kwargs: Any) -> Any:
    """Constructs the backend (the class is built lazily to keep this module import-light)."""
    return _backend_class()(*args, **kwargs)
