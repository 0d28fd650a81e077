"""``EtcdV3Store``: a ``torch.distributed.Store`` whose keys live in etcd.

The agents of a job use it to assign worker ranks and for the exit barrier (torch wraps it in a
per-round ``PrefixStore``). Unlike torch's c10d rendezvous, whose TCPStore is hosted by one of
the training nodes (the job dies with that node), this store lives in etcd's replicated keyspace
and survives the loss of any node.

Blocking calls (``get``, ``wait``, ``multi_get``) are woken by an etcd watch, not by polling, and
raise ``torch.distributed.DistStoreError`` on timeout, as TCPStore does. Counters (``add``) and
``compare_set`` are compare-and-swap loops on the key's mod revision.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from membership.etcd import EtcdClient
from torch_private import Store


def _encode(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdV3Store(Store):
    """A torch store over etcd keys under ``prefix``.

    Args:
        client: the etcd client.
        prefix: key prefix, e.g. ``/elastic/{run_id}/store/``.
        timeout: default timeout of blocking ``get``, ``multi_get`` and ``wait``.
    """

    def __init__(
        self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        if timeout <= timedelta(0):
            from elastic_errors import ConfigError

            raise ConfigError(f"store timeout ({timeout}) must be positive.")
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"EtcdV3Store(prefix={self._prefix!r}, client={self._client!r})"

    @property
    def prefix(self) -> str:
        """The etcd key prefix of every key of this store."""
        return self._prefix

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the default timeout of blocking calls."""
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        """The default timeout of blocking calls."""
        return self._timeout

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        """See base class."""
        self._client.put(self._key(key), _encode(value))

    def _wait_for(self, keys: Sequence[str], timeout: timedelta) -> list[bytes]:
        try:
            kvs = self._client.wait_for_keys([self._key(k) for k in keys], timeout)
        except TimeoutError as exc:
            raise dist.DistStoreError(
                f"Timed out after {timeout.total_seconds():g} s waiting for store keys "
                f"{list(keys)} under etcd prefix {self._prefix}."
            ) from exc
        return [kv.value for kv in kvs]

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """See base class."""
        return self._wait_for([key], self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        """See base class."""
        return self._wait_for(keys, self._timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:  # type: ignore[override]
        """See base class."""
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key."
            )
        self._client.put_many([(self._key(k), _encode(v)) for k, v in zip(keys, values,
                                                                            strict=True)])

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """See base class."""
        full = self._key(key)
        current = self._client.get(full)
        while True:
            raw = current.value if current else b"0"
            try:
                base = int(raw.decode())
            except ValueError as exc:
                raise ValueError(
                    f"store key {key!r} holds {raw[:32]!r}, not an integer; add() "
                    "needs a counter key."
                ) from exc
            written, after = self._client.cas(
                full, str(base + amount).encode(), current.mod_revision if current else None
            )
            if written:
                return base + amount
            current = after

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """See base class."""
        full = self._key(key)
        expected, desired = _encode(expected_value), _encode(desired_value)
        current = self._client.get(full)
        while True:
            if current is None:
                if expected:
                    return expected  # TCPStore's answer when the key does not exist
                written, current = self._client.cas(full, desired, None)
            elif current.value != expected:
                return current.value
            else:
                written, current = self._client.cas(full, desired, current.mod_revision)
            if written:
                return desired

    def wait(  # type: ignore[override]
        self, keys: list[str], timeout: timedelta | None = None
    ) -> None:
        """See base class."""
        self._wait_for(keys, timeout or self._timeout)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        """See base class."""
        return all(kv is not None for kv in self._client.get_many([self._key(k) for k in keys]))

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        """See base class."""
        return self._client.delete(self._key(key)) > 0

    def num_keys(self) -> int:  # type: ignore[override]
        """See base class."""
        return len(self._client.get_prefix(self._prefix))
