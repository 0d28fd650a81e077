"""Knowing at once that a peer node is gone, instead of waiting for its lease to expire.

A node whose agent and workers die together (an OOM kill of the tree, a crashed container on
a live host) leaves its node record in etcd until the agent's lease expires
(``--inplace-ttl``, 3 s): nobody is left on that node to delete it. Survivors whose collective
failed would sit out that TTL on every such loss. Each node agent therefore listens on a TCP
port of its own (the *liveness port*, ``probe_port`` in its node record and in the world's
members) and never reads from it:

* the kernel completes the handshake of a listening socket by itself, so a probe succeeds
  while the process lives, even when it is stopped or busy in a long step;
* when the process is gone the kernel answers with a reset: ``ECONNREFUSED`` means dead, at
  once and for certain;
* a host that vanished (spot reclaim without notice) answers nothing: the probe times out,
  says *unknown*, and the lease TTL decides as before.

A refusal is only trusted from a peer that accepted a probe before (:class:`ProbeBook`): a
firewall that rejects the port on some path must not make live peers look dead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

__all__ = ["LivenessSocket", "ProbeBook", "probe"]

logger = logging.getLogger(__name__)

#: How long one probe waits for a handshake before it says "unknown".
DEFAULT_PROBE_TIMEOUT_S: Final = 0.5
_MAX_PARALLEL_PROBES: Final = 32


class LivenessSocket:
    """A listening socket whose only job is to exist while this process does.

    A daemon thread accepts and closes connections so that the accept queue never fills
    (a full queue drops handshakes, which would read as "unknown", never as "dead").

    Args:
        host: Interface to listen on (all by default).
    """

    def __init__(self, host: str = "") -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        # A deep queue: a burst of probes while the drain thread waits for the GIL must not
        # overflow it (an overflow drops handshakes: "unknown", and the lease decides).
        self._sock.listen(socket.SOMAXCONN)
        self.port: int = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._drain, name="elastic-liveness",
                                        daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed: this worker is leaving
                return
            conn.close()

    def close(self) -> None:
        """Stops listening (peers' probes are refused from now on)."""
        with contextlib.suppress(OSError):  # never connected: nothing to shut down
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def probe(host: str, port: int, timeout: float = DEFAULT_PROBE_TIMEOUT_S) -> bool | None:
    """Whether a process listens on ``host:port``.

    Returns:
        ``True`` if the handshake completed, ``False`` if it was refused (nobody listens:
        the process is gone), ``None`` if it timed out or failed otherwise (unknown).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return False
        return None


def probe_all(addresses: Iterable[tuple[str, int]],
              timeout: float = DEFAULT_PROBE_TIMEOUT_S) -> dict[tuple[str, int], bool | None]:
    """:func:`probe` of every address, in parallel; address -> its answer."""
    todo = list(addresses)
    if not todo:
        return {}
    with ThreadPoolExecutor(max_workers=min(_MAX_PARALLEL_PROBES, len(todo)),
                            thread_name_prefix="elastic-probe") as pool:
        answers = list(pool.map(lambda a: probe(a[0], a[1], timeout), todo))
    return dict(zip(todo, answers, strict=True))


class ProbeBook:
    """Which peers answered a probe once, so that their refusal can be trusted later.

    Args:
        timeout: Seconds each probe waits for a handshake.
    """

    def __init__(self, timeout: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._answered: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def learn(self, addresses: Iterable[tuple[str, int]]) -> None:
        """Probes ``addresses`` and remembers those that accepted (call on a fresh world)."""
        with self._lock:
            todo = [a for a in addresses if a not in self._answered]
        answers = probe_all(todo, self.timeout)
        with self._lock:
            self._answered.update(a for a, alive in answers.items() if alive)

    def learn_in_background(self, addresses: Iterable[tuple[str, int]]) -> threading.Thread:
        """:meth:`learn` on a daemon thread (a world build must not wait for it)."""
        thread = threading.Thread(target=self.learn, args=(list(addresses),),
                                  name="elastic-probe-learn", daemon=True)
        thread.start()
        return thread

    def recheck(self, addresses: Iterable[tuple[str, int]]
                ) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
        """Probes the addresses that answered before.

        Returns:
            Those that now refuse (their process is gone, for certain), and those that now
            answer nothing within the timeout (their host is silent or cut off: unknown).
        """
        with self._lock:
            known = [a for a in addresses if a in self._answered]
        answers = probe_all(known, self.timeout)
        gone = {a for a, alive in answers.items() if alive is False}
        silent = {a for a, alive in answers.items() if alive is None}
        with self._lock:
            self._answered -= gone
        return gone, silent
