"""Worker to agent telemetry: each event record is one Unix datagram, and a worker never waits.

Under ``elastic-run`` the node agent (:mod:`launch.telemetry`) binds a datagram socket in a
private directory and exports its path as ``ELASTIC_TELEMETRY_SOCKET``. A worker's event log
(:meth:`elastic.eventlog.EventLog.from_env`) then sends every record there instead of writing
the job log itself; the agent passes the records on to its own event log, so they reach the
job's log (only the records marked *durable*: global rank 0's) and the node's live metrics
(every worker's).

Why datagrams: one record is one message (no framing, no partial reads, no connection state to
rebuild), and a send with ``MSG_DONTWAIT`` either queues the message in the kernel or fails at
once, so a worker never blocks on its agent. Linux queues at most ``net.unix.max_dgram_qlen``
datagrams on the agent's socket (10 by default), so a busy agent can briefly refuse more:

* ``EAGAIN``/``ENOBUFS`` (the agent's queue is full): the payload waits in a bounded backlog
  that every later send empties first, still without blocking; the backlog's oldest records
  are dropped when it overflows;
* no socket, or nobody bound to it (``ENOENT``, ``ECONNREFUSED``: the agent is gone): the
  record is dropped (reconnecting is tried at most once a second);
* a record too large for one datagram (``EMSGSIZE``): dropped.

Every drop is counted, and each datagram carries the worker's count so far (``dropped``), which
the agent exports as ``elastic_run_telemetry_dropped_total``.

Wire format, version 1: one UTF-8 JSON object per datagram::

    {"v": 1, "pid": 4242, "durable": true, "dropped": 0, "record": {...an event record...}}
"""

from __future__ import annotations

import atexit
import collections
import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

logger = logging.getLogger(__name__)

WIRE_VERSION: Final = 1
#: Records kept while the agent's queue is full (about a minute of steps at 10 steps/s).
DEFAULT_BACKLOG: Final = 1024
#: Largest datagram the agent reads; larger records are dropped by the sender.
MAX_DATAGRAM: Final = 60_000
_RECONNECT_EVERY_S: Final = 1.0
_FULL: Final = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS})


@dataclass(frozen=True, slots=True)
class Datagram:
    """One decoded telemetry datagram."""

    record: dict[str, Any]
    durable: bool
    pid: int
    dropped: int


def encode(record: Mapping[str, Any], *, durable: bool, pid: int, dropped: int) -> bytes:
    """The datagram of ``record`` (wire format above)."""
    return json.dumps({"v": WIRE_VERSION, "pid": pid, "durable": durable, "dropped": dropped,
                       "record": record}, default=str, separators=(",", ":")).encode()


def decode(payload: bytes) -> Datagram | None:
    """The datagram in ``payload``, or ``None`` when it is not one (foreign or damaged)."""
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(message, dict) or message.get("v") != WIRE_VERSION:
        return None
    record = message.get("record")
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return None
    pid, dropped = message.get("pid"), message.get("dropped")
    return Datagram(record=record, durable=bool(message.get("durable")),
                    pid=pid if isinstance(pid, int) else -1,
                    dropped=dropped if isinstance(dropped, int) else 0)


class TelemetrySender:
    """Sends records to the agent's socket at ``path``; never blocks, never raises.

    Thread-safe: the training thread and the checkpoint thread both record events. The lock is
    held only around non-blocking system calls.

    Args:
        path: The agent's socket (``ELASTIC_TELEMETRY_SOCKET``).
        backlog: Records kept while the agent's queue is full.
    """

    def __init__(self, path: str, *, backlog: int = DEFAULT_BACKLOG) -> None:
        self.path = path
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._backlog: collections.deque[tuple[Mapping[str, Any], bool]] = (
            collections.deque(maxlen=max(1, backlog)))
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        #: Records dropped so far (agent gone, backlog overflow, too large).
        self.dropped = 0
        #: Records handed to the kernel so far.
        self.sent = 0

    def send(self, record: Mapping[str, Any], *, durable: bool) -> bool:
        """Queues ``record`` for the agent; False when it was not sent now (backlog or drop)."""
        with self._lock:
            if self._backlog and not self._drain():
                self._keep(record, durable)
                return False
            outcome = self._send_one(record, durable)
            if outcome == "full":
                self._keep(record, durable)
            elif outcome == "dropped":
                self.dropped += 1
            return outcome == "sent"

    @property
    def backlog(self) -> int:
        """Records waiting for room in the agent's queue."""
        return len(self._backlog)

    def drain(self, timeout: float) -> bool:
        """Tries to send the backlog for up to ``timeout`` s (at exit); True when it is empty."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._backlog or self._drain():
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Closes the socket (the backlog is dropped and counted)."""
        with self._lock:
            self.dropped += len(self._backlog)
            self._backlog.clear()
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # -- internals (called with the lock held) ----------------------------------------------

    def _keep(self, record: Mapping[str, Any], durable: bool) -> None:
        if len(self._backlog) == self._backlog.maxlen:
            self.dropped += 1  # the oldest one falls out of the deque
        self._backlog.append((record, durable))

    def _drain(self) -> bool:
        """Sends backlog records oldest first; True once it is empty."""
        while self._backlog:
            record, durable = self._backlog[0]
            outcome = self._send_one(record, durable)
            if outcome == "full":
                return False
            self._backlog.popleft()
            if outcome == "dropped":
                self.dropped += 1
        return True

    def _connected(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._next_connect:
            return None
        self._next_connect = now + _RECONNECT_EVERY_S
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        self._sock = sock
        return sock

    def _send_one(self, record: Mapping[str, Any], durable: bool) -> str:
        """``sent``, ``full`` (try again later) or ``dropped``."""
        sock = self._connected()
        if sock is None:
            return "dropped"
        payload = encode(record, durable=durable, pid=self._pid, dropped=self.dropped)
        if len(payload) > MAX_DATAGRAM:
            logger.warning("Dropping a %d-byte %s event: larger than one telemetry datagram.",
                           len(payload), record.get("event"))
            return "dropped"
        try:
            sock.send(payload, socket.MSG_DONTWAIT)
        except OSError as exc:
            if exc.errno in _FULL:
                return "full"
            # ECONNREFUSED and friends: the agent's socket is gone; connect again later.
            sock.close()
            self._sock = None
            return "dropped"
        self.sent += 1
        return "sent"


class TelemetrySink:
    """An event sink (:class:`elastic.eventlog.EventSink`) that sends records to the agent.

    Args:
        sender: The process's sender.
        live: Also send records that are not durable (live metrics only); False for every
            worker of a node but one, whose records would repeat the reporter's.
    """

    def __init__(self, sender: TelemetrySender, *, live: bool = True) -> None:
        self.sender = sender
        self.live = live

    @property
    def enabled(self) -> bool:
        """Always true: the agent may come and go, records are counted when dropped."""
        return True

    def write(self, record: Mapping[str, Any], durable: bool) -> None:
        """Sends ``record`` (never blocks)."""
        if durable or self.live:
            self.sender.send(record, durable=durable)

    def flush(self, timeout: float) -> bool:
        """Tries to send the backlog within ``timeout`` s."""
        return self.sender.drain(timeout)

    def close(self, timeout: float) -> None:
        """Tries the backlog for up to ``timeout`` s, then closes the socket."""
        self.sender.drain(timeout)
        self.sender.close()


_senders: dict[str, TelemetrySender] = {}
_senders_lock = threading.Lock()
#: At a worker's exit, how long records still in the backlog get to reach the agent.
EXIT_DRAIN_S: Final = 0.5


def shared_sender(path: str) -> TelemetrySender:
    """The process's one sender to ``path`` (every event log of a worker shares it).

    Its backlog gets :data:`EXIT_DRAIN_S` at interpreter exit, so that the last step of a
    finishing worker still reaches the agent when its queue was full at that moment.
    """
    with _senders_lock:
        sender = _senders.get(path)
        if sender is None or sender._pid != os.getpid():  # a forked child gets its own
            sender = _senders[path] = TelemetrySender(path)
            atexit.register(sender.drain, EXIT_DRAIN_S)
        return sender
