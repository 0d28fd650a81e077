"""Telling a peer host that went silent from a slow one, before its lease expires.

A host that vanishes without a reset (a spot VM reclaimed without notice, a cut link, a kernel
panic) leaves its peers blocked in a collective until its lease expires: up to the whole
``--inplace-ttl`` after its last keep-alive, plus etcd's own expiry tick. Two observations
together tell sooner that it is gone:

* its agent's liveness port, which answered before, does not answer a TCP handshake within the
  probe timeout (its kernel completes handshakes even while every process on it is stopped or
  busy, so a stopped or hung worker never looks silent);
* etcd has had no keep-alive of its lease for longer than a whole keep-alive period (its agent
  refreshes it from a thread of its own every period).

Either alone happens in a healthy job (a congested path; a keep-alive late by a millisecond).
Both at once, while this node's workers wait for that host in a collective, mean the host is
gone or cut off from its peers *and* from etcd: revoking its lease then does at once what
expiry would do a second or two later. A host cut off from its peers only keeps refreshing its
lease, and one cut off from etcd only still answers probes: neither is ever removed this way,
so a partition never has two sides removing each other. A node that is itself cut off cannot
reach etcd to revoke anything.

The order of the questions matters (:func:`confirmed_silent`). A node whose own link comes
back between its probe and etcd's answer has probe results from while *it* was cut off, and
etcd's answer truncates the lease's remaining time to whole seconds, so a keep-alive a few
milliseconds late reads as a missed period. Either alone must not remove a healthy peer (a CI
run found exactly that: a cut node, its link just back, revoked the lease of the leader it had
failed to probe). So once etcd says the lease is unrefreshed, which proves this node reaches
etcd *now*, the peer is probed again, and then etcd is asked again: a peer that answers the
fresh probe, or whose keep-alive was only late, stays.

:class:`SilentPeerWatch` runs that check while a worker of this node reports waiting in a
collective (``stalled``), and stops once the step completes or the world changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Final

from elastic.contract.messages import StallRule
from membership.etcd import EtcdClient, keep_alive_period

__all__ = ["STALL_RULE", "SilentPeerWatch", "confirmed_silent", "lease_unrefreshed",
           "watched_peers"]

logger = logging.getLogger(__name__)

#: How long one etcd question of the check may take: a node that cannot reach etcd within it
#: is the one cut off, and must not wait on etcd while its workers are stuck.
ETCD_CHECK_DEADLINE: Final = timedelta(seconds=1)
#: Seconds between two checks while a worker still waits.
CHECK_INTERVAL_S: Final = 0.25
#: How many peers each node checks (see :func:`watched_peers`).
WATCHED_PEERS: Final = 3
#: A worker that waited in a collective this long (or this many median steps, if longer)
#: reports ``stalled``, and the check starts: cheap, and it acts only on two independent
#: signs, so it can start early. Workers get the rule in their agent's welcome.
STALL_FLOOR_S: Final = 0.5
STALL_FACTOR: Final = 3.0
#: The rule as the agent's welcome passes it on to its workers.
STALL_RULE: Final = StallRule(STALL_FLOOR_S, STALL_FACTOR)


def watched_peers(members: Sequence[str], me: str, count: int = WATCHED_PEERS) -> list[str]:
    """The peers ``me`` checks: the ``count`` members after it in the world's rank order,
    wrapping around.

    Every survivor of a collective waits when one member goes silent, so every member is
    still checked by ``count`` others, and one round of checks costs the job ``count`` probes
    per node instead of one per pair of nodes (a straggler on a 1024-node job must not set
    off a million handshakes).
    """
    if me not in members:
        return []
    at = members.index(me)
    others = [members[(at + i) % len(members)] for i in range(1, len(members))]
    return others[:count]


def confirmed_silent(lease_unrefreshed: Callable[[], bool],
                     probe_unanswered: Callable[[], bool]) -> bool:
    """Whether a peer that answered no probe is gone: its lease is unrefreshed, a probe sent
    *after* etcd answered (so while this node demonstrably reaches the network) is unanswered
    too, and its lease is still unrefreshed after that probe (the keep-alive was not merely
    late). Each question is asked only if the one before says "gone".

    Args:
        lease_unrefreshed: Asks etcd whether the peer's lease missed a keep-alive period
            (raises ``EtcdUnavailableError`` if etcd does not answer in time).
        probe_unanswered: Probes the peer's liveness port now; True if it does not answer.
    """
    return lease_unrefreshed() and probe_unanswered() and lease_unrefreshed()


def lease_unrefreshed(client: EtcdClient, lease_id: int,
                      deadline: timedelta = ETCD_CHECK_DEADLINE) -> bool:
    """Whether etcd has had no keep-alive of ``lease_id`` for over a keep-alive period.

    etcd reports the remaining TTL truncated to whole seconds, so a remaining ``r`` means more
    than ``granted - r - 1`` seconds have passed since the last refresh.

    Raises:
        EtcdUnavailableError: etcd did not answer within ``deadline``.
    """
    remaining, granted = client.lease_time_to_live(lease_id, deadline=deadline)
    if remaining < 0:
        return True  # already gone
    return granted - remaining - 1 >= keep_alive_period(granted)


class SilentPeerWatch:
    """Checks the peers of a world this node's workers wait in, until they stop waiting.

    Args:
        check: Called with the epoch the workers wait in, from a thread of this watch; looks
            for silent peers of that world and removes them. Returns whether the watch should
            stop (it removed one, or that epoch is no longer the current world).
        limit: Seconds after which a wait is no longer checked (by then a silent peer's lease
            has expired anyway: the node lease TTL plus a margin).
        interval: Seconds between two checks.
    """

    def __init__(self, check: Callable[[int], bool], *, limit: float,
                 interval: float = CHECK_INTERVAL_S) -> None:
        self._check = check
        self._interval = interval
        self._limit = limit
        self._wait: tuple[int, int] | None = None  # (epoch, step) the workers wait in
        self._since = 0.0
        self._settled = False  # the current wait needs no more checks
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def stalled(self, epoch: int, step: int) -> None:
        """A worker of this node waits in the collective of ``step`` in world ``epoch``."""
        with self._lock:
            if self._wait != (epoch, step):
                self._wait, self._since, self._settled = (epoch, step), time.monotonic(), False
            if self._thread is None and not self._settled and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="elastic-silent-peers")
                self._thread.start()

    def resumed(self) -> None:
        """The workers completed the step they waited in."""
        with self._lock:
            self._settled = True

    def close(self) -> None:
        """Stops checking (the agent is stopping)."""
        self._closed.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                wait = self._wait
                if time.monotonic() - self._since > self._limit:
                    self._settled = True
                if wait is None or self._settled or self._closed.is_set():
                    self._thread = None
                    return
            try:
                done = self._check(wait[0])
            except Exception:  # a check must never take the agent down
                logger.exception("checking for silent peers failed")
                done = True
            if done:
                with self._lock:
                    if self._wait == wait:
                        self._settled = True
            self._closed.wait(self._interval)
