"""``--rdzv-conf`` keys of elastic-run's rendezvous, and the etcd client they configure.

======================  ========  ============================================================
key                     default   meaning
======================  ========  ============================================================
join_timeout            600       seconds a node may wait for a world before it gives up
last_call_timeout       1         seconds joins settle before a world grows (several joins
                                  become one reconfiguration)
member_ttl              3         node lease TTL: a silent node is dropped this long after its
                                  last keep-alive (``--inplace-ttl`` sets it too)
linger                  0         seconds after a run's end during which a node that comes
                                  late exits (0 after a finished run) instead of starting a
                                  fresh run of the job id; 0: a job id is reusable at once
read_timeout            5         one etcd request
deadline                30        retrying etcd before the job fails, naming the endpoints
key_prefix              /elastic  prefix of every key of elastic-run
protocol                http      ``https`` for TLS (default when a CA is given)
ca_cert                 (none)    CA bundle (or ``ELASTIC_ETCD_CA_CERT``)
ssl_cert                (none)    client certificate (or ``ELASTIC_ETCD_CERT``)
ssl_cert_key            (none)    client key (or ``ELASTIC_ETCD_KEY``)
======================  ========  ============================================================

Credentials come only from ``ELASTIC_ETCD_USERNAME``/``ELASTIC_ETCD_PASSWORD``, never from
the command line (which every local user can read). torch's dynamic-rendezvous keys
(``heartbeat_timeout``, ``keep_alive_interval``, ...) mean nothing to this protocol: they
are accepted and ignored, with a warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from elastic import env
from elastic_errors import ConfigError
from membership.etcd import EtcdClient, config_from_env

__all__ = ["DEFAULTS", "RdzvConf", "client_for"]

logger = logging.getLogger(__name__)

DEFAULTS: Final[dict[str, float]] = {
    "join_timeout": 600.0,
    "last_call_timeout": 1.0,
    "member_ttl": 3.0,
    "linger": 0.0,
    "read_timeout": 5.0,
    "deadline": 30.0,
}
"""Numeric ``--rdzv-conf`` keys and their defaults."""

_STRING_KEYS: Final = frozenset({"key_prefix", "protocol", "ca_cert", "ssl_cert",
                                 "ssl_cert_key"})
# torch's dynamic rendezvous keys (torchrun users pass them), and what torch's launcher adds
# to every backend's config: accepted, meaningless here.
_IGNORED_KEYS: Final = frozenset({
    "close_timeout", "heartbeat_timeout", "keep_alive_interval", "keep_alive_max_attempt",
    "state_ttl", "timeout", "is_host", "rank", "use_libuv", "local_addr",
})
_TORCH_INTERNAL: Final = frozenset({"timeout", "is_host", "rank", "use_libuv", "local_addr"})


@dataclass(frozen=True, slots=True)
class RdzvConf:
    """Parsed ``--rdzv-conf`` values (see the module docstring)."""

    join_timeout: float
    last_call_timeout: float
    member_ttl: int
    linger: int
    read_timeout: float
    deadline: float
    key_prefix: str
    protocol: str | None
    ca_cert: str | None
    ssl_cert: str | None
    ssl_cert_key: str | None

    @classmethod
    def parse(cls, raw: Mapping[str, Any], *, member_ttl: int | None = None) -> RdzvConf:
        """Validates ``raw`` (``--rdzv-conf`` as a dict).

        Args:
            raw: The keys and values.
            member_ttl: ``--inplace-ttl``, used when ``member_ttl`` is not in ``raw``.

        Raises:
            ConfigError: On a bad value (one sentence naming the key and the value).
        """
        unknown = sorted(set(raw) - set(DEFAULTS) - _STRING_KEYS - _IGNORED_KEYS)
        if unknown:
            raise ConfigError(
                f"--rdzv-conf has unknown key(s) ({', '.join(unknown)}); the keys are "
                f"{', '.join(sorted(set(DEFAULTS) | _STRING_KEYS))}."
            )
        ignored = sorted((set(raw) & _IGNORED_KEYS) - _TORCH_INTERNAL)
        if ignored:
            logger.warning("ignoring --rdzv-conf key(s) %s: they tune torch's dynamic "
                           "rendezvous, which elastic-run does not use", ignored)
        numbers = {key: _number(raw, key, default, zero_ok=key == "linger")
                   for key, default in DEFAULTS.items()}
        if "member_ttl" not in raw and member_ttl is not None:
            numbers["member_ttl"] = float(member_ttl)
        if numbers["member_ttl"] < 1:
            raise ConfigError(f"the node lease TTL ({numbers['member_ttl']:g}) must be at "
                              "least 1 second; pass --inplace-ttl 3.")

        def text(key: str) -> str | None:
            value = raw.get(key)
            return str(value) if value not in (None, "") else None

        return cls(
            join_timeout=numbers["join_timeout"],
            last_call_timeout=numbers["last_call_timeout"],
            member_ttl=max(1, round(numbers["member_ttl"])),
            linger=round(numbers["linger"]),
            read_timeout=numbers["read_timeout"], deadline=numbers["deadline"],
            key_prefix=text("key_prefix") or "/elastic", protocol=text("protocol"),
            ca_cert=text("ca_cert"), ssl_cert=text("ssl_cert"),
            ssl_cert_key=text("ssl_cert_key"),
        )


def _number(raw: Mapping[str, Any], key: str, default: float, *,
            zero_ok: bool = False) -> float:
    value = raw.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if number < 0 or (number == 0 and not zero_ok) or number != number:
        what = "a number >= 0" if zero_ok else "a positive number"
        raise ConfigError(
            f"--rdzv-conf {key} ({value!r}) must be {what}; pass e.g. {key}={default:g}."
        )
    return number


def client_for(endpoint: str, conf: RdzvConf) -> EtcdClient:
    """The etcd client of a node agent (or of torchrun's agent through the plugin).

    Args:
        endpoint: ``host:port[,host:port...]``; ``$ELASTIC_ETCD_ENDPOINTS`` when empty.
        conf: The parsed ``--rdzv-conf``.

    Raises:
        ConfigError: For a missing or unparsable endpoint.
    """
    endpoint = endpoint or os.environ.get(env.ETCD_ENDPOINTS, "")
    if not endpoint:
        raise ConfigError(
            f"no etcd endpoint given; pass --etcd host:port or set {env.ETCD_ENDPOINTS}."
        )
    return EtcdClient(config_from_env(
        endpoint, protocol=conf.protocol, ca_cert=conf.ca_cert, cert=conf.ssl_cert,
        key=conf.ssl_cert_key, request_timeout=timedelta(seconds=conf.read_timeout),
        deadline=timedelta(seconds=conf.deadline),
    ))
