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

Step records are coalesced: a step record waits in the sender and goes with the steps after
it in one datagram, sent by the first step recorded :data:`COALESCE_S` or more after the
oldest waiting one, so a worker makes one system call, and its agent decodes, projects and logs
one message, per tenth of a second rather than per step (at 60 steps/s that was most of what
telemetry cost a step). A loop that stops recording (a hang, its end) leaves its last steps to
a daemon thread, which sends them 1.5 x :data:`COALESCE_S` after the oldest. Any other record
(a save, a failure) is sent at once, together with the steps waiting before it, so records
keep their order. A worker SIGKILLed loses at most its last 0.15 s of steps; one that exits
sends them (``atexit``, and the loop's ``close``).

Wire format, version 1: one UTF-8 JSON object per datagram, one record::

    {"v": 1, "pid": 4242, "durable": true, "dropped": 0, "record": {...an event record...}}

or several, oldest first (each with its durable flag)::

    {"v": 1, "pid": 4242, "dropped": 0, "records": [[true, {...}], [false, {...}], ...]}
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
#: Longest a coalesced step record waits in the worker before it is sent.
COALESCE_S: Final = 0.1
#: A coalesced record the training thread has not sent after this many ``COALESCE_S`` (the
#: loop stopped recording: it hangs, or it finished) is sent by the coalescing thread.
_STALLED: Final = 1.5
#: Most records in one datagram (about 200 bytes each: well under :data:`MAX_DATAGRAM`).
MAX_BATCH: Final = 128

_Item = tuple[Mapping[str, Any], bool]


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


def encode_batch(items: list[_Item], *, pid: int, dropped: int) -> bytes:
    """The datagram of several ``(record, durable)`` items, oldest first (wire format above)."""
    if len(items) == 1:
        return encode(items[0][0], durable=items[0][1], pid=pid, dropped=dropped)
    return json.dumps({"v": WIRE_VERSION, "pid": pid, "dropped": dropped,
                       "records": [[durable, record] for record, durable in items]},
                      default=str, separators=(",", ":")).encode()


def decode_all(payload: bytes) -> list[Datagram]:
    """Every record in ``payload`` (one, or a batch), oldest first; empty when it is not
    telemetry (foreign or damaged). A batch's malformed items are skipped."""
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return []
    if not isinstance(message, dict) or message.get("v") != WIRE_VERSION:
        return []
    pid, dropped = message.get("pid"), message.get("dropped")
    pid = pid if isinstance(pid, int) else -1
    dropped = dropped if isinstance(dropped, int) else 0
    items: Any = message.get("records")
    if not isinstance(items, list):
        items = [[message.get("durable"), message.get("record")]]
    return [Datagram(record=item[1], durable=bool(item[0]), pid=pid, dropped=dropped)
            for item in items
            if isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)
            and isinstance(item[1].get("event"), str)]


class TelemetrySender:
    """Sends records to the agent's socket at ``path``; never blocks, never raises.

    Thread-safe: the training thread, the checkpoint thread and the coalescing thread all
    send. The lock is held only around non-blocking system calls.

    Args:
        path: The agent's socket (``ELASTIC_TELEMETRY_SOCKET``).
        backlog: Datagrams kept while the agent's queue is full.
        coalesce_s: Age of the oldest coalesced record at which the next one sends them all
            (the coalescing thread sends them at 1.5 times that age).
    """

    def __init__(self, path: str, *, backlog: int = DEFAULT_BACKLOG,
                 coalesce_s: float = COALESCE_S) -> None:
        self.path = path
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._backlog: collections.deque[list[_Item]] = collections.deque()
        self._backlog_max = max(1, backlog)
        self._pending: list[_Item] = []
        self._coalesce_s = coalesce_s
        self._wake = threading.Event()  # set while records are pending
        self._oldest = 0.0  # monotonic time of the oldest pending record
        self._flusher: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        #: Records dropped so far (agent gone, backlog overflow, too large).
        self.dropped = 0
        #: Records handed to the kernel so far.
        self.sent = 0

    def send(self, record: Mapping[str, Any], *, durable: bool, coalesce: bool = False) -> bool:
        """Queues ``record`` for the agent; False when it was not sent now (backlog, drop, or
        coalesced).

        Args:
            record: The event record.
            durable: Whether it belongs in the job log.
            coalesce: Let it wait (at most 1.5 ``coalesce_s``) to go with later records in one
                datagram; otherwise it goes now, with every record waiting before it.
        """
        with self._lock:
            self._pending.append((record, durable))
            if coalesce and len(self._pending) < MAX_BATCH:
                now = time.monotonic()
                if len(self._pending) == 1:
                    self._oldest = now
                    if not self._wake.is_set():
                        self._arm()
                    return False
                if now - self._oldest < self._coalesce_s:
                    return False
            # Sent by the caller (the training thread) whenever it can: waking the coalescing
            # thread to send costs the worker more than sending, so that thread only covers
            # a loop that stopped recording.
            items, self._pending = self._pending, []
            return self._post(items)

    @property
    def backlog(self) -> int:
        """Datagrams waiting for room in the agent's queue."""
        return len(self._backlog)

    @property
    def pending(self) -> int:
        """Coalesced records not sent yet."""
        return len(self._pending)

    def send_pending(self) -> None:
        """Sends the coalesced records now."""
        with self._lock:
            if self._pending:
                items, self._pending = self._pending, []
                self._post(items)

    def drain(self, timeout: float) -> bool:
        """Sends the coalesced records, then tries the backlog for up to ``timeout`` s (at
        exit); True when nothing is left."""
        self.send_pending()
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._backlog or self._drain():
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Closes the socket (records not sent are dropped and counted)."""
        with self._lock:
            self.dropped += sum(len(items) for items in self._backlog) + len(self._pending)
            self._backlog.clear()
            self._pending = []
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    # -- internals (called with the lock held) ----------------------------------------------

    def _arm(self) -> None:
        """Has the coalescing thread watch the pending records (and send them if the caller
        does not within ``1.5 * coalesce_s``)."""
        if self._flusher is None or not self._flusher.is_alive():
            # A daemon: it dies with the worker (whose atexit drain sends what is pending).
            self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                             name="telemetry-coalesce")
            self._flusher.start()
        self._wake.set()

    def _flush_loop(self) -> None:
        due = _STALLED * self._coalesce_s
        while True:
            self._wake.wait()
            with self._lock:
                wait = self._oldest + due - time.monotonic() if self._pending else 0.0
            if wait > 0:
                time.sleep(wait)
                continue
            with self._lock:
                if self._pending and time.monotonic() - self._oldest >= due:
                    items, self._pending = self._pending, []
                    self._post(items)
                if not self._pending:
                    self._wake.clear()

    def _post(self, items: list[_Item]) -> bool:
        """Sends ``items`` as one datagram after the backlog; True when sent now."""
        self._backlog.append(items)
        while len(self._backlog) > self._backlog_max:
            self.dropped += len(self._backlog.popleft())  # the oldest falls out
        dropped = self.dropped
        return self._drain() and self.dropped == dropped

    def _drain(self) -> bool:
        """Sends backlog datagrams oldest first; True once it is empty."""
        while self._backlog:
            items = self._backlog[0]
            outcome = self._send_one(items)
            if outcome == "full":
                return False
            self._backlog.popleft()
            if outcome == "too_large" and len(items) > 1:
                # Too many records for one datagram: send them in halves, in order.
                half = len(items) // 2
                self._backlog.extendleft([items[half:], items[:half]])
            elif outcome != "sent":
                if outcome == "too_large":
                    logger.warning("Dropping a %s event: larger than one telemetry datagram.",
                                   items[0][0].get("event"))
                self.dropped += len(items)
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

    def _send_one(self, items: list[_Item]) -> str:
        """``sent``, ``full`` (try again later), ``too_large`` or ``dropped`` (the agent is
        gone)."""
        sock = self._connected()
        if sock is None:
            return "dropped"
        payload = encode_batch(items, pid=self._pid, dropped=self.dropped)
        if len(payload) > MAX_DATAGRAM:
            return "too_large"
        try:
            sock.send(payload, socket.MSG_DONTWAIT)
        except OSError as exc:
            if exc.errno in _FULL:
                return "full"
            # ECONNREFUSED and friends: the agent's socket is gone; connect again later.
            sock.close()
            self._sock = None
            return "dropped"
        self.sent += len(items)
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

    @property
    def takes_live(self) -> bool:
        """Whether records that are not durable are sent (the node's reporter only)."""
        return self.live

    def write(self, record: Mapping[str, Any], durable: bool) -> None:
        """Sends ``record`` (never blocks); step records are coalesced (module doc)."""
        if durable or self.live:
            self.sender.send(record, durable=durable, coalesce=record.get("event") == "step")

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
