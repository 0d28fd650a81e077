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

:class:`SilentPeerWatch` runs that check while a worker of this node reports waiting in a
collective (``stalled``), and stops once the step completes or the world changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Final

from elastic.etcd import EtcdClient, keep_alive_period

__all__ = ["SilentPeerWatch", "lease_unrefreshed"]

logger = logging.getLogger(__name__)

#: How long one etcd question of the check may take: a node that cannot reach etcd within it
#: is the one cut off, and must not wait on etcd while its workers are stuck.
ETCD_CHECK_DEADLINE: Final = timedelta(seconds=1)
#: Seconds between two checks while a worker still waits.
CHECK_INTERVAL_S: Final = 0.25


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
        interval: Seconds between two checks.
    """

    def __init__(self, check: Callable[[int], bool],
                 interval: float = CHECK_INTERVAL_S) -> None:
        self._check = check
        self._interval = interval
        self._epoch: int | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def stalled(self, epoch: int) -> None:
        """A worker of this node waits in a collective of world ``epoch``."""
        with self._lock:
            self._epoch = epoch
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="elastic-silent-peers")
                self._thread.start()

    def resumed(self) -> None:
        """The workers completed the step they waited in."""
        with self._lock:
            self._epoch = None

    def close(self) -> None:
        """Stops checking (the agent is stopping)."""
        self._closed.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                epoch = self._epoch
                if epoch is None or self._closed.is_set():
                    self._thread = None
                    return
            try:
                done = self._check(epoch)
            except Exception:  # a check must never take the agent down
                logger.exception("checking for silent peers failed")
                done = True
            if done:
                with self._lock:
                    if self._epoch == epoch:
                        self._epoch = None
            self._closed.wait(self._interval)
