"""The liveness port: a live process (even a stopped one) accepts, a dead one refuses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from membership.liveness import LivenessSocket, ProbeBook, probe

_CHILD = textwrap.dedent(
    """
    import sys, time
    from membership.liveness import LivenessSocket
    sock = LivenessSocket()
    print(sock.port, flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _port_of(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    return int(proc.stdout.readline())


def test_a_live_process_accepts_even_when_stopped_and_a_killed_one_refuses(
    child: subprocess.Popen[str],
) -> None:
    port = _port_of(child)
    assert probe("127.0.0.1", port) is True
    os.kill(child.pid, signal.SIGSTOP)  # a stalled worker is not a dead one
    try:
        assert probe("127.0.0.1", port) is True
    finally:
        os.kill(child.pid, signal.SIGCONT)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert probe("127.0.0.1", port) is False


def test_many_probes_never_make_a_live_process_look_dead_nor_fill_the_queue() -> None:
    sock = LivenessSocket()
    try:
        # Under load a probe may time out (its handshake waiting for a retransmit): that is
        # "unknown", never "dead".
        answers = [probe("127.0.0.1", sock.port) for _ in range(300)]
        assert False not in answers
        # The drain thread keeps the queue from staying full: a patient probe gets through.
        assert probe("127.0.0.1", sock.port, timeout=10.0) is True
    finally:
        sock.close()
    assert probe("127.0.0.1", sock.port) is False


def test_a_handshake_that_never_completes_is_unknown_not_dead() -> None:
    # A host that vanished answers nothing. Stand-in here: a listener whose accept queue is
    # full and never drained, so the kernel drops further handshakes (no reset is sent).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        assert probe("127.0.0.1", port, timeout=0.3) is None
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_a_refusal_counts_only_from_a_peer_that_answered_before(
    child: subprocess.Popen[str],
) -> None:
    port = _port_of(child)
    never_seen = LivenessSocket()
    never_seen_port = never_seen.port
    never_seen.close()  # a port that refuses from the start (a firewall rejecting it, say)
    book = ProbeBook()
    book.learn([("127.0.0.1", port), ("127.0.0.1", never_seen_port)])
    assert book.recheck([("127.0.0.1", port), ("127.0.0.1", never_seen_port)]) == (set(), set())
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    assert book.recheck([("127.0.0.1", port), ("127.0.0.1", never_seen_port)]) == (
        {("127.0.0.1", port)}, set())
