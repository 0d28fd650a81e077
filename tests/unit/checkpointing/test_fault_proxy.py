"""The test fault proxy forwards, resets, blackholes and heals as it says (real sockets)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.support.fault_proxy import FaultProxy, Mode


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A loopback echo server."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # the proxy resets some on purpose
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    stop.set()
    server.close()


def _connect(proxy: FaultProxy) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=10)


def _echo(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _is_broken(sock: socket.socket) -> bool:
    try:
        sock.sendall(b"x")
        return sock.recv(1) == b""
    except OSError:
        return True


def test_forwards_then_resets_open_and_new_connections_until_healed(echo_port: int) -> None:
    with FaultProxy("127.0.0.1", echo_port) as proxy:
        before = _connect(proxy)
        assert _echo(before, b"hello") == b"hello"
        proxy.reset()
        assert proxy.mode() is Mode.RESET
        assert _is_broken(before)
        # Accepted, then reset at once: the RST can already fail the connect itself.
        try:
            during = _connect(proxy)
        except ConnectionResetError:
            pass
        else:
            assert _is_broken(during)
            during.close()
        assert proxy.faulted >= 2
        proxy.heal()
        after = _connect(proxy)
        assert _echo(after, b"again") == b"again"
        before.close()
        after.close()


def test_blackhole_holds_bytes_and_delivers_them_after_heal(echo_port: int) -> None:
    with FaultProxy("127.0.0.1", echo_port) as proxy:
        sock = _connect(proxy)
        assert _echo(sock, b"a") == b"a"
        proxy.blackhole()
        sock.sendall(b"held")
        assert proxy.wait_for_fault(timeout=10)
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(10)  # nothing comes back while the hole is open
        proxy.heal()
        sock.settimeout(10)
        assert _echo(sock, b"") == b"" and sock.recv(10) == b"held"
        sock.close()


def test_timed_outage_ends_by_itself() -> None:
    with FaultProxy("127.0.0.1", 9) as proxy:
        proxy.reset(seconds=0.05)
        threading.Event().wait(0.2)  # the outage's end is compared on the monotonic clock
        assert not proxy.in_outage()


def test_arm_starts_the_outage_after_the_given_bytes(echo_port: int) -> None:
    with FaultProxy("127.0.0.1", echo_port) as proxy:
        sock = _connect(proxy)
        proxy.arm(after_bytes=1000, mode="reset")
        assert _echo(sock, b"x" * 500) == b"x" * 500
        assert not proxy.in_outage()
        sock.sendall(b"y" * 600)
        assert proxy.wait_until_outage(timeout=10)
        assert proxy.mode() is Mode.RESET and _is_broken(sock)
        sock.close()


def test_close_stops_every_thread(echo_port: int) -> None:
    proxy = FaultProxy("127.0.0.1", echo_port)
    sock = _connect(proxy)
    assert _echo(sock, b"z") == b"z"
    proxy.blackhole()
    sock.sendall(b"held")
    assert proxy.wait_for_fault(timeout=10)
    proxy.close()
    names = {t.name for t in threading.enumerate()}
    assert not any(n.startswith(f"fault-proxy-{proxy.port}") for n in names)
    sock.close()
