"""``EtcdV3Store``: a ``torch.distributed.Store`` whose keys live in etcd.

The agents of a job use it to assign worker ranks and for the exit barrier. Unlike torch's
c10d rendezvous, whose TCPStore is hosted by one of the training nodes (the job dies with that
node), this store lives in etcd's replicated keyspace and survives the loss of any node.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Final

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from elastic.etcd import EtcdClient

_POLL_S: Final = 0.02
_MAX_POLL_S: Final = 0.25


def _encode(value: str | bytes | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdV3Store(Store):
    """A torch store over etcd keys under ``prefix``.

    Args:
        client: the etcd client.
        prefix: key prefix, e.g. ``/elastic/{run_id}/store/``.
        timeout: default timeout of blocking ``get`` and ``wait``.
    """

    def __init__(
        self, client: EtcdClient, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._timeout = timeout

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
        deadline = time.monotonic() + timeout.total_seconds()
        delay = _POLL_S
        while True:
            values = [self._client.get(self._key(k)) for k in keys]
            if all(v is not None for v in values):
                return [v.value for v in values if v is not None]
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise dist.DistStoreError(
                    f"Timed out after {timeout.total_seconds():g} s waiting for store keys "
                    f"{missing} in etcd."
                )
            time.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)

    def get(self, key: str) -> bytes:  # type: ignore[override]
        """See base class."""
        return self._wait_for([key], self._timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        """See base class."""
        return self._wait_for(keys, self._timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:  # type: ignore[override]
        """See base class."""
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        """See base class."""
        full = self._key(key)
        current = self._client.get(full)
        while True:
            base = int(current.value.decode()) if current else 0
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
        while True:
            current = self._client.get(full)
            if current is None:
                if expected:
                    return expected
                written, after = self._client.cas(full, desired, None)
            elif current.value != expected:
                return current.value
            else:
                written, after = self._client.cas(full, desired, current.mod_revision)
            if written:
                return desired
            if after is not None and after.value != expected:
                return after.value

    def wait(  # type: ignore[override]
        self, keys: list[str], timeout: timedelta | None = None
    ) -> None:
        """See base class."""
        self._wait_for(keys, timeout or self._timeout)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        """See base class."""
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        """See base class."""
        return self._client.delete(self._key(key)) > 0

    def num_keys(self) -> int:  # type: ignore[override]
        """See base class."""
        return len(self._client.get_prefix(self._prefix))
