"""A start-up check that etcd answers, so a wrong endpoint fails in seconds, not at join timeout.

It uses the project's etcd client with the same TLS files and credentials as the rendezvous
(``--rdzv-conf`` keys, then the ``ELASTIC_ETCD_*`` environment variables), so a CA that does not
match, a client certificate etcd refuses or a wrong password is reported at once, in one
sentence naming the endpoint, instead of after the rendezvous deadline. An etcd that is not up
yet is retried until the timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

from elastic_errors import EtcdAccessError, EtcdUnavailableError

logger = logging.getLogger(__name__)

_ATTEMPT_TIMEOUT_S: Final = 2.0


def probe(endpoints: str, timeout: timedelta, conf: Mapping[str, Any] | None = None) -> None:
    """Return once an endpoint of ``endpoints`` answers and accepts this client.

    Args:
        endpoints: ``host:port[,host:port...]``.
        timeout: how long to keep trying while nothing answers.
        conf: the rendezvous configuration (``protocol``, ``ca_cert``, ``ssl_cert``,
            ``ssl_cert_key``); missing keys come from the environment.

    Raises:
        EtcdAccessError: etcd answered but refused this client (TLS or credentials).
        EtcdUnavailableError: nothing answered within ``timeout``.
        ConfigError: an endpoint or a TLS file is invalid.
    """
    from membership.etcd import EtcdClient, config_from_env

    conf = conf or {}
    deadline = timedelta(seconds=max(timeout.total_seconds(), 0.1))
    config = config_from_env(
        endpoints,
        protocol=conf.get("protocol") or None,
        ca_cert=conf.get("ca_cert") or None,
        cert=conf.get("ssl_cert") or None,
        key=conf.get("ssl_cert_key") or None,
        request_timeout=min(timedelta(seconds=_ATTEMPT_TIMEOUT_S), deadline),
        deadline=deadline,
    )
    client = EtcdClient(config)
    try:
        # With credentials configured this logs in first, so a wrong password fails here.
        client.status()
    except EtcdAccessError:
        raise
    except EtcdUnavailableError as exc:
        last = exc.__cause__ or exc  # the last transient failure, e.g. "url: ConnectionError"
        raise EtcdUnavailableError(
            f"no etcd answered at ({endpoints}) within {deadline.total_seconds():g} s (last "
            f"error: {last}); check --etcd / ELASTIC_ETCD_ENDPOINTS and that etcd is running."
        ) from exc
    finally:
        client.close()
