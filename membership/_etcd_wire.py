"""The wire format of etcd's JSON gateway, shared by the client and its watches (private).

Keys and values travel base64-encoded and int64 fields as JSON strings; :func:`decode_kv`
turns a gateway ``KeyValue`` into :class:`KeyValue`. :data:`RETRY_POLICY` is the one retry
policy of the etcd boundary.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import Any, Final

from tenacity import Retrying, before_sleep_log, retry_if_exception_type, wait_exponential_jitter

__all__ = ["MAX_TXN_OPS", "RETRY_POLICY", "KeyValue", "Transient", "b64", "decode_kv",
           "prefix_range_end"]

logger = logging.getLogger("membership.etcd")


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd returned it."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


MAX_TXN_OPS: Final = 100
"""Operations per transaction; etcd refuses more than ``--max-txn-ops`` (128 by default)."""


class Transient(Exception):
    """A failure worth retrying on another endpoint or later."""


RETRY_POLICY: Final = Retrying(
    wait=wait_exponential_jitter(multiplier=0.05, max=1.0),
    retry=retry_if_exception_type(Transient),
    before_sleep=before_sleep_log(logger, logging.DEBUG),
    reraise=True,
)
"""The one retry policy of the etcd boundary; each call copies it with its own deadline."""


def b64(data: str | bytes) -> str:
    """Encodes a key or value for the gateway."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def prefix_range_end(prefix: str) -> str:
    """The (encoded) ``range_end`` that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return b64(bytes(raw[: i + 1]))
    return b64(b"\0")


def decode_kv(item: dict[str, Any]) -> KeyValue:
    """Decodes one gateway ``KeyValue`` (base64 fields, int64 as strings)."""
    return KeyValue(
        # A key name that is not UTF-8 can only be foreign (anyone who may write the prefix
        # can create one): it must not take a watch down; it is ignored as any foreign key.
        key=base64.b64decode(item["key"]).decode(errors="replace"),
        value=base64.b64decode(item.get("value", "")),
        mod_revision=int(item.get("mod_revision", 0)),
        create_revision=int(item.get("create_revision", 0)),
        lease=int(item.get("lease", 0)),
    )


