"""A node's own membership: its record under its own key, on its own lease.

The agent is the only writer of its key, so every write is a plain put that never conflicts:
a join is one put, a change of the node's workers is one put, and staying alive costs no
write at all (the lease keep-alive). When the node dies or goes silent, etcd expires the
lease on its own clock and deletes the key; nobody compares wall clocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

from elastic.contract.records import NodeRecord
from elastic_errors import EtcdUnavailableError
from membership.etcd import EtcdClient, Lease
from membership.keys import JobKeys

__all__ = ["NodeMembership"]

logger = logging.getLogger(__name__)

#: How long :meth:`NodeMembership.repair` waits for etcd's answer.
REPAIR_DEADLINE: Final = timedelta(seconds=2)


class NodeMembership:
    """Publishes and updates one node record, and holds the node's lease.

    Thread-safe: the agent's main loop and its channel threads update the record
    concurrently; writes are serialized and the newest record always wins.

    Args:
        client: The etcd client.
        keys: The run's keys (generation chosen).
        ttl: Lease TTL in seconds: how long a silent node stays a member.
        on_lost: Called once (from the keep-alive thread) when etcd dropped the lease while
            this process lived (a partition or a stall longer than ``ttl``); the node is no
            longer a member and must join again under a new id.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, *, ttl: int,
                 on_lost: Callable[[], None] | None = None) -> None:
        self._client = client
        self._keys = keys
        self._ttl = ttl
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._record: NodeRecord | None = None
        self._lease: Lease | None = None
        self._left = False
        #: Puts of this node's record so far (the cost of membership, counted by tests).
        self.writes = 0
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

    def join(self, record: NodeRecord) -> None:
        """Grants the lease and writes the record (one put)."""
        with self._lock:
            self._left = False
            self._lease = self._client.lease(self._ttl, on_lost=self._lease_lost)
            self._record = record
            self._put(record)
        logger.info("joined run %s as node %s (%s, lease %x, ttl %d s)", self._keys.root,
                    record.node, record.addr, self._lease.id, self._ttl)

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
        assert self._lease is not None
        self._written_at = self._client.put(self._keys.node(record.node), record.dumps(),
                                            lease=self._lease.id)
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
        logger.warning("node %s lost its lease: etcd dropped it from the run",
                       self._record.node if self._record else "?")
        if self._on_lost is not None:
            self._on_lost()

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
