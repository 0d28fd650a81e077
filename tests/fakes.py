"""In-memory stand-ins for unit tests (each next to a test of the real thing).

:class:`FakeEtcd` duck-types :class:`membership.etcd.EtcdClient` with etcd's semantics: one global
revision, create/mod revisions per key, leases that expire on a fake clock (:meth:`advance`) and
delete their keys, prefix watches that deliver events on their own thread (the first snapshot
from the constructor, as the real watch does), transactions that take one revision and deliver
one batch of events, and compare-and-swap that returns the current value when it fails. The
contract tests in ``tests/contracts.py`` run against it (``tests/unit/elastic/test_fake_etcd.py``)
and against a real etcd (``tests/integration/etcd/test_contracts.py``), which is what keeps it
faithful.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from elastic.errors import EtcdUnavailableError
from membership.etcd import EtcdConfig, KeyValue, Lease, LeaseGoneError, WatchEvent


@dataclass
class _LeaseRecord:
    ttl: int
    expires_at: float


class FakePrefixWatch:
    """The in-memory twin of :class:`membership.etcd.PrefixWatch`."""

    def __init__(
        self, fake: FakeEtcd, prefix: str,
        on_change: Callable[[Sequence[WatchEvent]], None] | None,
    ) -> None:
        self._fake = fake
        self._prefix = prefix
        self._on_change = on_change
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[list[WatchEvent] | None] = queue.SimpleQueue()
        self.failed = threading.Event()
        self.error: EtcdUnavailableError | None = None
        self.reconnects = 0
        kvs, self._revision = fake.snapshot(prefix)
        self._mirror = {kv.key: kv for kv in kvs}
        if kvs and on_change is not None:
            # As the real watch does: the first snapshot reaches on_change, from the
            # constructor, as PUT events at the snapshot's revision.
            on_change([WatchEvent("PUT", kv.key, kv, self._revision) for kv in kvs])
        self._thread = threading.Thread(target=self._run, daemon=True, name="fake-watch")
        self._thread.start()

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def revision(self) -> int:
        with self._cond:
            return self._revision

    def items(self) -> dict[str, KeyValue]:
        with self._cond:
            return dict(self._mirror)

    def wait_for(
        self, predicate: Callable[[Mapping[str, KeyValue]], bool], timeout: timedelta
    ) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._mirror),
                                       timeout.total_seconds())

    def deliver(self, events: list[WatchEvent]) -> None:
        self._queue.put(events)

    def cancel(self) -> None:
        self._fake.remove_watch(self)
        self._queue.put(None)

    def _run(self) -> None:
        while (events := self._queue.get()) is not None:
            events = [e for e in events if e.revision > self._revision]
            if not events:
                continue
            with self._cond:
                for event in events:
                    if event.kv is not None:
                        self._mirror[event.key] = event.kv
                    else:
                        self._mirror.pop(event.key, None)
                    self._revision = event.revision
                self._cond.notify_all()
            if self._on_change is not None:
                self._on_change(events)


class FakeEtcd:
    """An in-memory etcd with a fake clock, for unit tests.

    Args:
        endpoints: what error messages name.
    """

    def __init__(self, endpoints: tuple[str, ...] = ("fake-etcd:2379",)) -> None:
        self.config = EtcdConfig(endpoints=endpoints, request_timeout=timedelta(seconds=1),
                                 deadline=timedelta(seconds=2))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._kv: dict[str, KeyValue] = {}
        self._revision = 1
        self._leases: dict[int, _LeaseRecord] = {}
        self._next_lease = 0x1000
        self._watches: list[FakePrefixWatch] = []
        self.now = 0.0
        """The fake clock (seconds) that lease expiry follows."""
        self.down = False
        """When true every call fails as an unreachable etcd would."""
        self.calls: dict[str, int] = {}
        """How often each operation was called."""
        self.cas_conflicts = 0

    def __repr__(self) -> str:
        return f"FakeEtcd(revision={self._revision}, keys={len(self._kv)})"

    @property
    def endpoints_text(self) -> str:
        return ",".join(self.config.endpoints)

    # -- fault injection and the clock -------------------------------------------------------

    def _enter(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.down:
            raise EtcdUnavailableError(
                f"etcd ({self.endpoints_text}) did not answer within 2 s (fake outage); check "
                "that etcd is running and reachable."
            )

    def advance(self, seconds: float) -> None:
        """Moves the fake clock on, expiring every lease not refreshed in time."""
        with self._lock:
            self.now += seconds
            for lease_id, record in list(self._leases.items()):
                if record.expires_at <= self.now:
                    self._drop_lease(lease_id)

    def expire_lease(self, lease_id: int) -> None:
        """Expires a lease now, as etcd does when its holder died."""
        with self._lock:
            self._drop_lease(lease_id)

    def corrupt(self, key: str, value: bytes) -> None:
        """Overwrites a key with arbitrary bytes, bypassing every check."""
        self.put(key, value)

    # -- internals ----------------------------------------------------------------------------

    def _bump(self) -> int:
        self._revision += 1
        return self._revision

    def _write(self, key: str, value: bytes, lease: int, *, revision: int | None = None,
               batch: list[WatchEvent] | None = None) -> KeyValue:
        """Writes one key; within a transaction (``revision`` given) its event joins
        ``batch``, which the caller delivers once: one revision, one batch, as etcd does."""
        if lease and lease not in self._leases:
            raise LeaseGoneError(f"etcd ({self.endpoints_text}) no longer holds lease "
                                 f"{lease:x} (it expired or was revoked)")
        if revision is None:
            revision = self._bump()
        old = self._kv.get(key)
        kv = KeyValue(key=key, value=value, mod_revision=revision,
                      create_revision=old.create_revision if old else revision, lease=lease)
        self._kv[key] = kv
        event = WatchEvent("PUT", key, kv, revision)
        if batch is None:
            self._notify([event])
        else:
            batch.append(event)
        return kv

    def _remove(self, keys: Sequence[str]) -> int:
        present = [k for k in keys if k in self._kv]
        if not present:
            return 0
        revision = self._bump()
        for key in present:
            del self._kv[key]
        self._notify([WatchEvent("DELETE", k, None, revision) for k in present])
        return len(present)

    def _drop_lease(self, lease_id: int) -> None:
        if self._leases.pop(lease_id, None) is not None:
            self._remove([k for k, kv in self._kv.items() if kv.lease == lease_id])

    def _notify(self, events: list[WatchEvent]) -> None:
        self._changed.notify_all()
        for watch in list(self._watches):
            mine = [e for e in events if e.key.startswith(watch.prefix)]
            if mine:
                watch.deliver(mine)

    def remove_watch(self, watch: FakePrefixWatch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    # -- the EtcdClient interface -------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            self._enter("get")
            return self._kv.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self.snapshot(prefix)[0]

    def snapshot(self, prefix: str) -> tuple[list[KeyValue], int]:
        with self._lock:
            self._enter("range")
            kvs = sorted((kv for k, kv in self._kv.items() if k.startswith(prefix)),
                         key=lambda kv: kv.key)
            return kvs, self._revision

    def get_many(self, keys: Sequence[str]) -> list[KeyValue | None]:
        return self.get_many_at(keys)[0]

    def get_many_at(self, keys: Sequence[str]) -> tuple[list[KeyValue | None], int]:
        with self._lock:
            self._enter("get_many")
            return [self._kv.get(k) for k in keys], self._revision

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        with self._lock:
            self._enter("put")
            return self._write(key, value, lease).mod_revision

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        with self._lock:
            self._enter("put_many")
            revision = self._bump()
            batch: list[WatchEvent] = []
            for key, value in items:
                self._write(key, value, 0, revision=revision, batch=batch)
            self._notify(batch)
            return revision

    def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        return self.cas(key, value, None, lease=lease)[0]

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int | None, *, lease: int = 0,
        delete_range: tuple[str, str] | None = None, fence: tuple[str, int] | None = None,
    ) -> tuple[bool, KeyValue | None]:
        with self._lock:
            self._enter("cas")
            current = self._kv.get(key)
            if expected_mod_revision is None:
                ok = current is None
            else:
                ok = current is not None and current.mod_revision == expected_mod_revision
            if fence is not None:
                fenced = self._kv.get(fence[0])
                ok = ok and fenced is not None and fenced.create_revision == fence[1]
            if not ok:
                self.cas_conflicts += 1
                return False, current
            if delete_range is not None:
                start, end = delete_range
                if start <= key < end:
                    raise EtcdUnavailableError(
                        f"etcd ({self.endpoints_text}) rejected the request with HTTP 400 "
                        "(etcdserver: duplicate key given in txn request); check the request.")
                # One revision and one batch of events for the whole transaction, as etcd
                # gives them.
                doomed = [k for k in self._kv if start <= k < end]
                batch: list[WatchEvent] = []
                written = self._write(key, value, lease, revision=self._bump(), batch=batch)
                for k in doomed:
                    del self._kv[k]
                batch += [WatchEvent("DELETE", k, None, written.mod_revision) for k in doomed]
                self._notify(batch)
                return True, written
            return True, self._write(key, value, lease)

    def delete(self, key: str) -> int:
        with self._lock:
            self._enter("delete")
            return self._remove([key])

    def delete_prefix(self, prefix: str) -> int:
        with self._lock:
            self._enter("delete")
            return self._remove([k for k in self._kv if k.startswith(prefix)])

    def attach_prefix_to_lease(self, prefix: str, lease: int) -> int:
        with self._lock:
            self._enter("attach_prefix_to_lease")
            present = [kv for k, kv in self._kv.items() if k.startswith(prefix)]
            if not present:
                return 0
            revision = self._bump()
            batch: list[WatchEvent] = []
            for kv in present:
                self._write(kv.key, kv.value, lease, revision=revision, batch=batch)
            self._notify(batch)
            return len(present)

    def grant_lease(self, ttl: int) -> int:
        with self._lock:
            self._enter("grant")
            self._next_lease += 1
            self._leases[self._next_lease] = _LeaseRecord(ttl, self.now + max(ttl, 2))
            return self._next_lease

    def keep_alive_once(self, lease_id: int, *, deadline: timedelta | None = None) -> int:
        with self._lock:
            self._enter("keepalive")
            record = self._leases.get(lease_id)
            if record is None:
                return 0
            record.expires_at = self.now + max(record.ttl, 2)
            return record.ttl

    def revoke_lease(self, lease_id: int) -> None:
        with self._lock:
            self._enter("revoke")
            self._drop_lease(lease_id)

    def lease(self, ttl: int, *, on_lost: Callable[[Lease], None] | None = None) -> Lease:
        return Lease(self, ttl, on_lost=on_lost)  # type: ignore[arg-type]

    def lease_ids(self) -> list[int]:
        """Ids of the live leases."""
        with self._lock:
            return list(self._leases)

    def watch_prefix(
        self, prefix: str, *, on_change: Callable[[Sequence[WatchEvent]], None] | None = None,
        idle_reconnect: timedelta = timedelta(seconds=10),
    ) -> FakePrefixWatch:
        with self._lock:
            self._enter("watch")
            watch = FakePrefixWatch(self, prefix, on_change)
            self._watches.append(watch)
            return watch

    def wait_for_keys(self, keys: Sequence[str], timeout: timedelta) -> list[KeyValue]:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            self._enter("wait")
            while True:
                values = [self._kv.get(k) for k in keys]
                if all(v is not None for v in values):
                    return [v for v in values if v is not None]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                    raise TimeoutError(
                        f"timed out after {timeout.total_seconds():g} s waiting for etcd keys "
                        f"{missing}"
                    )
                self._changed.wait(remaining)

    def close(self) -> None:
        pass


def fake_client(fake: FakeEtcd) -> Any:
    """``fake`` typed as :class:`membership.etcd.EtcdClient` for the code under test."""
    return fake

