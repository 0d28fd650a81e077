"""A TCP fault proxy for tests: forward to a real server, then break the path on demand.

Put :class:`FaultProxy` between a client and a live server (moto's S3, etcd, ...) and point
the client at :attr:`FaultProxy.endpoint`. At any time, switch it to an outage:

* :meth:`FaultProxy.reset` - every open connection is reset (RST) and every new one is
  accepted and reset at once, as when the server's host drops or restarts;
* :meth:`FaultProxy.blackhole` - connections stay open but nothing gets through in either
  direction (new ones are accepted and never answered), as in a network partition; when it
  ends, the held bytes flow again, like TCP retransmissions after the partition heals.

An outage lasts ``seconds`` or, with ``seconds=None``, until :meth:`FaultProxy.heal`.
:meth:`FaultProxy.arm` starts an outage once a number of client bytes went through, so a
test can break a transfer in its middle without guessing how long it takes. Counters
(:attr:`FaultProxy.faulted`) tell a test that the client really ran into the outage.

Every thread is a daemon and :meth:`FaultProxy.close` (or leaving the ``with`` block) stops
them all, so a failing test cannot leave the proxy running.

Example::

    with FaultProxy("127.0.0.1", moto_port) as proxy:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint})
        proxy.reset(seconds=5)   # the next 5 s of requests fail with connection resets
"""

from __future__ import annotations

import contextlib
import enum
import logging
import select
import socket
import struct
import threading
import time
from types import TracebackType

logger = logging.getLogger(__name__)

_CHUNK = 64 * 1024
#: How often blocked loops look at the proxy's state and at ``close``, in seconds.
_POLL_S = 0.05


class Mode(str, enum.Enum):
    """What the proxy does with traffic."""

    FORWARD = "forward"
    RESET = "reset"
    BLACKHOLE = "blackhole"


def _rst_close(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN, so the peer sees 'connection reset by peer'."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """A threaded TCP forwarder from ``listen_host:port`` to ``target_host:target_port``.

    Args:
        target_host: Host of the real server.
        target_port: Its port.
        listen_host: Address to listen on; the port is chosen by the OS.
        connect_timeout_s: Timeout of the proxy's own connection to the target.

    Attributes:
        host: The address the proxy listens on.
        port: The port it listens on.
        accepted: Connections accepted so far.
        faulted: Connections the proxy reset or held during an outage so far.
        forwarded_bytes: Client-to-server bytes forwarded so far.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.target = (target_host, int(target_port))
        self.connect_timeout_s = connect_timeout_s
        self._cond = threading.Condition()
        self._mode = Mode.FORWARD
        self._until: float | None = None
        self._armed: tuple[int, Mode, float | None] | None = None
        self._closed = False
        self._conns: set[_Conn] = set()
        self.accepted = 0
        self.faulted = 0
        self._faults_before_outage = 0
        self.forwarded_bytes = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((listen_host, 0))
        self._listener.listen(128)
        # Closing a socket does not wake a thread blocked in accept(): poll instead.
        self._listener.settimeout(_POLL_S)
        self.host, self.port = self._listener.getsockname()[:2]
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True
        )
        self._acceptor.start()

    # ------------------------------------------------------------------------------ control
    @property
    def endpoint(self) -> str:
        """``http://host:port`` of the proxy, for HTTP clients."""
        return f"http://{self.host}:{self.port}"

    def mode(self) -> Mode:
        """The mode in force now (an outage whose time ran out reads as ``FORWARD``)."""
        with self._cond:
            return self._current()

    def in_outage(self) -> bool:
        """Whether an outage is in force now."""
        return self.mode() is not Mode.FORWARD

    def reset(self, seconds: float | None = None) -> None:
        """Reset open connections and every new one, for ``seconds`` (``None``: until heal)."""
        self._set(Mode.RESET, seconds)

    def blackhole(self, seconds: float | None = None) -> None:
        """Stop all traffic without closing anything, for ``seconds`` (``None``: until heal)."""
        self._set(Mode.BLACKHOLE, seconds)

    def heal(self) -> None:
        """End any outage (and disarm :meth:`arm`) now; held traffic flows again."""
        with self._cond:
            self._armed = None
            self._mode, self._until = Mode.FORWARD, None
            self._cond.notify_all()

    def arm(self, after_bytes: int, mode: Mode | str, seconds: float | None = None) -> None:
        """Start an outage once ``after_bytes`` more client bytes have been forwarded.

        Args:
            after_bytes: Client-to-server bytes to let through first.
            mode: ``"reset"`` or ``"blackhole"``.
            seconds: Length of the outage; ``None`` lasts until :meth:`heal`.
        """
        mode = Mode(mode)
        if mode is Mode.FORWARD:
            raise ValueError("arm() needs an outage mode ('reset' or 'blackhole'), not forward.")
        with self._cond:
            self._armed = (self.forwarded_bytes + int(after_bytes), mode, seconds)

    def wait_for_fault(self, timeout: float) -> bool:
        """Block until traffic has met the latest outage; ``False`` on timeout.

        Traffic meets a reset outage when a new connection is reset, and a blackhole when a
        connection or bytes are held.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.faulted == self._faults_before_outage and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _POLL_S))
            return self.faulted > self._faults_before_outage

    def wait_until_outage(self, timeout: float) -> bool:
        """Block until an outage is in force (e.g. after :meth:`arm`); ``False`` on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._current() is Mode.FORWARD and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _POLL_S))
            return self._current() is not Mode.FORWARD

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._listener.close()
        for conn in conns:
            conn.close(rst=False)
        self._acceptor.join(timeout=5)
        for conn in conns:
            conn.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------- internals
    def _set(self, mode: Mode, seconds: float | None) -> None:
        with self._cond:
            self._enter(mode, seconds)

    def _enter(self, mode: Mode, seconds: float | None) -> None:
        """Switch to ``mode``; the caller holds ``_cond``."""
        self._armed = None
        self._mode = mode
        self._until = None if seconds is None else time.monotonic() + seconds
        logger.info("fault proxy :%d -> %s for %s s", self.port, mode.value, seconds)
        if mode is Mode.RESET:
            for conn in list(self._conns):
                self.faulted += 1
                conn.close(rst=True)
        # wait_for_fault() waits for traffic that meets the outage, not for the resets above
        # (an idle pooled connection reset here may never be used again).
        self._faults_before_outage = self.faulted
        self._cond.notify_all()

    def _current(self) -> Mode:
        """The mode now; the caller holds ``_cond``."""
        if self._until is not None and time.monotonic() >= self._until:
            self._mode, self._until = Mode.FORWARD, None
            self._cond.notify_all()
        return self._mode

    def _count_forwarded(self, n: int) -> None:
        with self._cond:
            self.forwarded_bytes += n
            if self._armed is not None and self.forwarded_bytes >= self._armed[0]:
                _, mode, seconds = self._armed
                self._enter(mode, seconds)

    def _gate(self, conn: _Conn) -> bool:
        """Block while blackholed; ``False`` when ``conn`` must stop (reset, closed)."""
        with self._cond:
            held = False
            while True:
                if self._closed or conn.closed:
                    return False
                mode = self._current()
                if mode is Mode.FORWARD:
                    return True
                if mode is Mode.RESET:
                    self.faulted += 1
                    conn.close(rst=True)
                    return False
                if not held:
                    held = True
                    self.faulted += 1
                    self._cond.notify_all()
                self._cond.wait(_POLL_S)

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                if self._closed:
                    return
                continue
            except OSError:
                return  # the listener was closed
            client.settimeout(None)
            with self._cond:
                if self._closed:
                    client.close()
                    return
                self.accepted += 1
                if self._current() is Mode.RESET:
                    self.faulted += 1
                    self._cond.notify_all()
                    _rst_close(client)
                    continue
                conn = _Conn(self, client)
                self._conns.add(conn)
            conn.start()

    def _forget(self, conn: _Conn) -> None:
        with self._cond:
            self._conns.discard(conn)


class _Conn:
    """One proxied connection: a thread that connects upstream and pumps both ways."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"fault-proxy-{proxy.port}-conn", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self, *, rst: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            if rst:
                _rst_close(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()

    def _run(self) -> None:
        try:
            # A connection accepted during a blackhole is held before it even reaches the
            # server, like a SYN lost in a partition.
            if not self.proxy._gate(self):
                return
            try:
                upstream = socket.create_connection(
                    self.proxy.target, timeout=self.proxy.connect_timeout_s
                )
            except OSError:
                self.close(rst=True)
                return
            upstream.settimeout(None)
            with self._lock:
                if self.closed:
                    upstream.close()
                    return
                self.upstream = upstream
            self._pump(upstream)
        finally:
            self.close(rst=False)
            self.proxy._forget(self)

    def _pump(self, upstream: socket.socket) -> None:
        peers = {self.client: upstream, upstream: self.client}
        while not self.closed:
            try:
                readable, _, _ = select.select(list(peers), [], [], _POLL_S)
            except (OSError, ValueError):
                return  # a socket was closed under us (reset, close)
            for src in readable:
                try:
                    data = src.recv(_CHUNK)
                except OSError:
                    return
                if not data:
                    return
                # Held here during a blackhole: the bytes are neither sent nor dropped.
                if not self.proxy._gate(self):
                    return
                try:
                    peers[src].sendall(data)
                except OSError:
                    return
                if src is self.client:
                    self.proxy._count_forwarded(len(data))
