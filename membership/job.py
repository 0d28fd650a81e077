"""One agent's part in the membership protocol: its node, its view of the run, the leader loop.

:class:`RunMembership` is what the node agent (and the torchrun plugin handler) use; it
hides how the pieces are wired. See the package docstring for the protocol.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

from elastic.contract.records import EndRecord, NodeRecord, WorldRecord
from elastic_errors import EtcdUnavailableError
from membership.decide import RunLimits
from membership.etcd import EtcdClient
from membership.generation import DEFAULT_LINGER_S, end_run
from membership.keys import JobKeys
from membership.leader import LeaderLoop
from membership.node import DEFAULT_REJOIN_TIMEOUT_S, NodeMembership
from membership.silent_peers import lease_unrefreshed
from membership.view import JobView

__all__ = ["RunMembership", "new_node_id"]

logger = logging.getLogger(__name__)

#: How often a node checks that its record still holds what it wrote.
RECORD_CHECK_S: Final = 5.0
#: How long the read of the world after joining again may take.
REJOIN_READ_DEADLINE: Final = timedelta(seconds=5)


def new_node_id(host: str | None = None) -> str:
    """A node id unique per agent incarnation: ``{host}-{8 random hex}``.

    Unique even when pods share a host name and a PID layout, and different after a restart
    of the same agent, so an old incarnation's record can never be mistaken for the new one.
    """
    name = (host or socket.gethostname()).replace("/", "_") or "node"
    return f"{name}-{secrets.token_hex(4)}"


class RunMembership:
    """Joins one run as one node and follows its worlds.

    Args:
        client: The etcd client.
        keys: The run's keys (from :func:`~membership.generation.open_run`).
        limits: Node counts and settle time.
        ttl: The node lease TTL (how long a silent node stays a member).
        linger: Seconds the run's end record stays for nodes that come late (0: a short
            while, for ``elastic-run status``).
        on_change: Called (from a watch thread, must not block) whenever the control keys
            change: a new world, a new leader, the run's end.
        on_lease_lost: Called each time etcd dropped this node's lease (see
            :class:`NodeMembership`: the node then joins again on its own, same id).
        on_rejoined: Called once the node joined again after losing its lease.
        rejoin_timeout: Seconds a node that lost its lease keeps trying to join again.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, *, limits: RunLimits, ttl: int,
                 linger: int = DEFAULT_LINGER_S, on_change: Callable[[], None] | None = None,
                 on_lease_lost: Callable[[], None] | None = None,
                 on_rejoined: Callable[[], None] | None = None,
                 rejoin_timeout: float = DEFAULT_REJOIN_TIMEOUT_S) -> None:
        self.client = client
        self.keys = keys
        self.limits = limits
        self.linger = linger
        self._on_rejoined = on_rejoined
        self._world_at_rejoin = 0
        self.node = NodeMembership(client, keys, ttl=ttl, on_lost=on_lease_lost,
                                   on_rejoined=self._rejoined, rejoin_timeout=rejoin_timeout)
        self.view = JobView(client, keys, on_change=on_change)
        self.leader = LeaderLoop(client, keys, self.node, self.view, limits, self.end)
        self._stopped = threading.Event()
        self._ending = threading.Lock()  # held while this node records the run's end
        self._repairs = threading.Thread(target=self._repair_records, daemon=True,
                                         name="elastic-record-repair")

    def join(self, record: NodeRecord) -> None:
        """Publishes this node and starts campaigning for leadership."""
        self.node.join(record)
        self.leader.start()
        self._repairs.start()

    def _repair_records(self) -> None:
        """Every :data:`RECORD_CHECK_S`, puts this node's record back if someone overwrote
        it (see :meth:`NodeMembership.repair`)."""
        while not self._stopped.wait(RECORD_CHECK_S):
            if not self.view.watch.failed.is_set() and self.node.repair():
                self.leader.poke()

    def _rejoined(self) -> None:
        # The world as etcd holds it now: until the watch shows at least this one, this node
        # may be looking at a world the others replaced while it was out.
        try:
            kv = self.client.get(self.keys.world, deadline=REJOIN_READ_DEADLINE)
            self._world_at_rejoin = kv.mod_revision if kv is not None else 0
        except EtcdUnavailableError as exc:
            logger.warning("could not read the world after joining again (%s)", exc)
        self.leader.poke()
        if self._on_rejoined is not None:
            self._on_rejoined()

    def in_sync(self) -> bool:
        """Whether this node is certainly a member now and its view shows the run as of its
        (re)join: its lease is fresh, and, after it joined again, the watched world is at
        least the one etcd held then (a node back from a lost lease must not act on a world
        the others replaced while it was out)."""
        kv = self.view.world_kv()
        seen = kv.mod_revision if kv is not None else 0
        return self.node.fresh() and seen >= self._world_at_rejoin

    def peer_lease(self, node: str, *, deadline: timedelta | None = None) -> int | None:
        """The lease of another node's record: ``None`` if the record is gone (its lease
        expired, or it left), 0 if it is on no lease.

        Raises:
            EtcdUnavailableError: If etcd does not answer within ``deadline``.
        """
        kv = self.client.get(self.keys.node(node), deadline=deadline)
        return None if kv is None else kv.lease

    def lease_unrefreshed(self, lease: int, *, deadline: timedelta) -> bool:
        """Whether etcd has had no keep-alive of ``lease`` (a peer's) for over a keep-alive
        period (:func:`~membership.silent_peers.lease_unrefreshed`).

        Raises:
            EtcdUnavailableError: If etcd does not answer within ``deadline``.
        """
        return lease_unrefreshed(self.client, lease, deadline)

    def evict(self, node: str, why: str, *, lease: int | None = None,
              deadline: timedelta | None = None) -> None:
        """Removes another node that is gone from the run, as its lease's expiry would, but
        now: revokes its lease (its record and any leadership go at once), or deletes its
        record if it holds none. The only membership write one node makes for another.

        Args:
            node: The node.
            why: Why it is gone (logged).
            lease: Its lease, from :meth:`peer_lease` (read again when ``None``).
            deadline: How long etcd may take to answer.

        Raises:
            EtcdUnavailableError: If etcd does not answer within ``deadline``.
        """
        if lease is None:
            lease = self.peer_lease(node, deadline=deadline) or 0
        if lease:
            self.client.revoke_lease(lease, deadline=deadline)
        else:
            self.client.delete(self.keys.node(node))
        logger.warning("node %s is gone (%s); revoked its lease (its record and any "
                       "leadership go)", node, why)

    def update(self, **changes: Any) -> NodeRecord:
        """Rewrites this node's record with ``changes`` and lets the leader decide again."""
        record = self.node.update(**changes)
        self.leader.poke()
        return record

    @property
    def me(self) -> str:
        """This node's id."""
        return self.node.record.node

    def world(self) -> WorldRecord | None:
        """The current world (from memory)."""
        return self.view.world()

    def wait(self, predicate: Callable[[JobView], bool], timeout: float) -> bool:
        """Waits until ``predicate(view)`` holds (woken by the watch)."""
        return self.view.wait(predicate, timeout)

    def end(self, end: EndRecord) -> bool:
        """Ends the run (once, whoever calls first); returns whether this call did."""
        with self._ending:
            return end_run(self.client, self.keys, end, linger=self.linger)

    def leave(self) -> None:
        """Stops leading, revokes the lease (the node record goes at once), stops watching.

        An end in progress on another thread (the leader's, when every member is done)
        completes first: the others see its end record as soon as its first write lands
        and leave, and the process must not exit before the job generation is marked ended
        (nodes that come late read it). Each of its etcd calls is bounded by the deadline.
        """
        if self._ending.acquire(timeout=self.client.config.deadline.total_seconds()):
            self._ending.release()
        self._stopped.set()
        self.leader.stop()
        self.node.leave()
        self.view.close()

