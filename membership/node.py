"""A node's own membership: its record under its own key, on its own lease.

The agent is the only writer of its key, so every write is a plain put that never conflicts:
a join is one put, a change of the node's workers is one put, and staying alive costs no
write at all (the lease keep-alive). When the node dies or goes silent, etcd expires the
lease on its own clock and deletes the key; nobody compares wall clocks.

A lease that expires while the node lives (etcd stalled past the TTL, a long pause of this
process, a host starved of CPU, a cut link) is a normal event, not the node's end: the node
takes a new lease and writes its record again, under the same node id, as soon as etcd
answers (:meth:`NodeMembership.rejoin_in_background`, a tenacity policy with a deadline).
Meanwhile the others may have moved on without it; it is then a newcomer like any other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from elastic.contract.records import NodeRecord
from elastic_errors import EtcdUnavailableError
from membership.etcd import EtcdClient, Lease, LeaseGoneError
from membership.keys import JobKeys

__all__ = ["NodeMembership"]

logger = logging.getLogger(__name__)

#: How long :meth:`NodeMembership.repair` waits for etcd's answer.
REPAIR_DEADLINE: Final = timedelta(seconds=2)
#: How long a node whose lease expired keeps trying to join again by default.
DEFAULT_REJOIN_TIMEOUT_S: Final = 600.0


class NodeMembership:
    """Publishes and updates one node record, and holds the node's lease.

    Thread-safe: the agent's main loop and its channel threads update the record
    concurrently; writes are serialized and the newest record always wins.

    Args:
        client: The etcd client.
        keys: The run's keys (generation chosen).
        ttl: Lease TTL in seconds: how long a silent node stays a member.
        on_lost: Called (from the keep-alive thread) each time etcd dropped the lease while
            this process lived (a partition, or a stall longer than ``ttl``); the node then
            joins again on its own, under the same id, and calls ``on_rejoined``.
        on_rejoined: Called (from the rejoin thread) once the record is back on a new lease.
        rejoin_timeout: Seconds a node keeps trying to join again after losing its lease.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, *, ttl: int,
                 on_lost: Callable[[], None] | None = None,
                 on_rejoined: Callable[[], None] | None = None,
                 rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT_S) -> None:
        self._client = client
        self._keys = keys
        self._ttl = ttl
        self._on_lost = on_lost
        self._on_rejoined = on_rejoined
        self._rejoin_timeout = rejoin_timeout
        self._lock = threading.Lock()
        self._record: NodeRecord | None = None
        self._lease: Lease | None = None
        self._left = False
        self._rejoining = threading.Lock()  # held by the one rejoin thread
        #: Puts of this node's record so far (the cost of membership, counted by tests).
        self.writes = 0
        #: Times this node took a new lease after losing one.
        self.rejoins = 0
        self._written_at = 0  # the revision of this node's last put of its record

    @property
    def record(self) -> NodeRecord:
        """The record as last written."""
        if self._record is None:
            raise RuntimeError("NodeMembership.join() must be called first")
        return self._record

    @property
    def lease(self) -> Lease | None:
        """The node's lease (``None`` before joining)."""
        return self._lease

    @property
    def key(self) -> str:
        """The node's etcd key."""
        return self._keys.node(self.record.node)

    def fresh(self) -> bool:
        """Whether the node is certainly still a member (see :meth:`Lease.fresh`)."""
        lease = self._lease
        return lease is not None and lease.fresh()

    @property
    def lost(self) -> bool:
        """Whether etcd dropped the current lease and the node has not joined again yet."""
        lease = self._lease
        return lease is not None and lease.lost.is_set()

    def join(self, record: NodeRecord) -> None:
        """Grants the lease and writes the record (one put)."""
        with self._lock:
            self._left = False
            self._record = record
            self._new_lease()
            self._put(record)
        assert self._lease is not None
        logger.info("joined run %s as node %s (%s, lease %x, ttl %d s)", self._keys.root,
                    record.node, record.addr, self._lease.id, self._ttl)

    def _new_lease(self) -> None:
        """Takes a fresh lease (the old one is gone or never was); the lock is held."""
        old, self._lease = self._lease, self._client.lease(self._ttl, on_lost=self._lease_lost)
        if old is not None:
            old.stop()

    def update(self, **changes: Any) -> NodeRecord:
        """Writes the record with ``changes`` (no write if nothing changes); returns it."""
        with self._lock:
            current = self.record
            updated = current.with_changes(**changes)
            if updated != current and not self._left:
                self._record = updated
                self._put(updated)
                return updated
            return current

    def _put(self, record: NodeRecord) -> None:
        """Puts ``record`` on the lease; the lock is held. A lease etcd no longer holds (it
        expired before its keep-alive thread noticed) is replaced once, then the put again."""
        assert self._lease is not None
        try:
            revision = self._client.put(self._keys.node(record.node), record.dumps(),
                                        lease=self._lease.id)
        except LeaseGoneError:
            logger.warning("node %s: etcd no longer holds its lease; taking a new one",
                           record.node)
            self._new_lease()
            self.rejoins += 1
            revision = self._client.put(self._keys.node(record.node), record.dumps(),
                                        lease=self._lease.id)
        self._written_at = revision
        self.writes += 1

    def repair(self) -> bool:
        """Writes the record again if its key no longer holds it; returns whether it did.

        Only this node writes its key, but anyone who may write the job's keys can overwrite
        it (the leader ignores a foreign value: the node would silently drop out of every
        world). One read of the key's revision, answered within
        :data:`REPAIR_DEADLINE`; a read that fails is left to the next check, and a lost
        lease to the agent (it joins again as a new node).
        """
        if self._left or self._record is None or self._lease is None:
            return False
        key = self.key
        try:
            kv = self._client.get(key, deadline=REPAIR_DEADLINE)
        except EtcdUnavailableError:
            return False
        if kv is None:
            return False  # deleted: the lease decides (a peer that found this node dead)
        revision = kv.mod_revision
        with self._lock:
            # Equal: the key holds our record; older: a put of ours came after the read.
            if (self._left or self._lease is None or revision <= self._written_at
                    or not self._lease.fresh()):
                return False
            logger.warning("etcd key %s no longer holds this node's record (overwritten by "
                           "someone else): writing it again", key)
            try:
                self._put(self._record)
            except EtcdUnavailableError:
                return False
            return True

    def _lease_lost(self, lease: Lease) -> None:
        if self._left or lease is not self._lease:
            return
        logger.warning("node %s lost its lease: etcd dropped it from the run; it joins again",
                       self._record.node if self._record else "?")
        if self._on_lost is not None:
            self._on_lost()
        self.rejoin_in_background()

    def rejoin_in_background(self) -> threading.Thread | None:
        """Takes a new lease and writes the record again on a daemon thread, retrying while
        etcd does not answer, for up to ``rejoin_timeout`` seconds (one thread at a time;
        ``None`` if one already runs)."""
        if not self._rejoining.acquire(blocking=False):
            return None
        thread = threading.Thread(target=self._rejoin, name="elastic-rejoin", daemon=True)
        thread.start()
        return thread

    def _rejoin(self) -> None:
        policy = Retrying(
            stop=stop_after_delay(self._rejoin_timeout),
            wait=wait_exponential_jitter(multiplier=0.1, max=2.0, jitter=0.2),
            retry=retry_if_exception_type(EtcdUnavailableError),
            before_sleep=before_sleep_log(logger, logging.DEBUG),
            reraise=True,
        )
        try:
            rejoined = policy(self._rejoin_once)
        except EtcdUnavailableError as exc:
            logger.error("node %s could not join again within %.0f s (%s)",
                         self._record.node if self._record else "?", self._rejoin_timeout, exc)
            return
        finally:
            self._rejoining.release()
        if rejoined and self._on_rejoined is not None:
            self._on_rejoined()

    def _rejoin_once(self) -> bool:
        """Whether the node is back on a live lease (this call, or a put that renewed it)."""
        with self._lock:
            if self._left or self._record is None:
                return False
            if self.lost:
                self._new_lease()
                self._put(self._record)
                self.rejoins += 1
                assert self._lease is not None
                logger.info("node %s joined again (lease %x)", self._record.node,
                            self._lease.id)
        return True

    def leave(self) -> None:
        """Revokes the lease: the record goes at once and the others see this node leave."""
        with self._lock:
            self._left = True
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.revoke()

    def stop_refreshing(self) -> None:
        """Lets the lease expire by itself (used when etcd is known unreachable)."""
        lease = self._lease
        if lease is not None:
            lease.stop()
