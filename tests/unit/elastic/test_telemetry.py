"""Worker to agent telemetry over a real Unix datagram socket: delivered, never blocking."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic import env
from elastic.eventlog import EventLog, read_events
from elastic.telemetry import TelemetrySender, decode_all, encode
from launch.telemetry import TelemetryReceiver


class _Inbox:
    def __init__(self) -> None:
        self.items: list[tuple[dict[str, Any], bool]] = []
        self._cond = threading.Condition()

    def __call__(self, record: dict[str, Any], durable: bool) -> None:
        with self._cond:
            self.items.append((record, durable))
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = 10.0) -> list[tuple[dict[str, Any], bool]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.items) >= count, timeout), self.items
            return list(self.items)


@pytest.fixture
def inbox() -> Iterator[tuple[_Inbox, TelemetryReceiver]]:
    box = _Inbox()
    receiver = TelemetryReceiver(box).start()
    try:
        yield box, receiver
    finally:
        receiver.stop()


def test_records_arrive_with_their_durable_flag_and_the_socket_is_private(
    inbox: tuple[_Inbox, TelemetryReceiver],
) -> None:
    box, receiver = inbox
    assert os.stat(os.path.dirname(receiver.path)).st_mode & 0o777 == 0o700
    sender = TelemetrySender(receiver.path)
    assert sender.send({"event": "step", "step": 1}, durable=True)
    assert sender.send({"event": "step", "step": 1, "rank": 1}, durable=False)
    items = box.wait_for(2)
    assert [(r["step"], durable) for r, durable in items] == [(1, True), (1, False)]
    assert sender.dropped == 0 and receiver.received == 2


def test_a_worker_whose_agent_is_gone_drops_and_counts_without_waiting(tmp_path: Path) -> None:
    sender = TelemetrySender(str(tmp_path / "nobody.sock"))
    for step in range(100):
        assert not sender.send({"event": "step", "step": step}, durable=True)
    assert sender.dropped == 100 and sender.backlog == 0


def test_a_slow_agent_never_blocks_the_worker_and_the_backlog_catches_up(
    tmp_path: Path,
) -> None:
    # A bound socket that nobody reads: the kernel queue fills after a few datagrams.
    path = str(tmp_path / "slow.sock")
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    slow.bind(path)
    sender = TelemetrySender(path, backlog=50)
    done = threading.Event()

    def worker() -> None:
        for step in range(2000):
            sender.send({"event": "step", "step": step}, durable=True)
        done.set()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    # A blocking send would hang here for good; a non-blocking one finishes.
    assert done.wait(30), "the worker blocked on a full agent socket"
    queued = sender.sent
    assert sender.backlog == 50
    assert queued + sender.backlog + sender.dropped == 2000
    assert sender.dropped == 2000 - queued - 50
    # The agent reads again: the next send first empties the backlog, oldest first.
    slow.setblocking(False)
    received: list[int] = []

    def read_queued() -> None:
        while True:
            try:
                (datagram,) = decode_all(slow.recv(70_000))
            except BlockingIOError:
                return
            received.append(datagram.record["step"])

    deadline = time.monotonic() + 10
    while sender.backlog and time.monotonic() < deadline:
        read_queued()
        sender.drain(0.0)
    read_queued()
    assert sender.backlog == 0
    tail = [s for s in received if s >= 1950]
    assert tail == list(range(1950, 2000))  # the newest 50 waited and arrived in order
    slow.close()


def test_a_restarted_agent_is_found_again(tmp_path: Path) -> None:
    box = _Inbox()
    first = TelemetryReceiver(box).start()
    sender = TelemetrySender(first.path)
    assert sender.send({"event": "step", "step": 0}, durable=True)
    box.wait_for(1)
    path = first.path
    first.stop()
    assert not sender.send({"event": "step", "step": 1}, durable=True)  # refused: dropped
    again = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    again.bind(path)
    again.settimeout(5)
    time.sleep(1.1)  # reconnecting is tried at most once a second
    assert sender.send({"event": "step", "step": 2}, durable=True)
    (datagram,) = decode_all(again.recv(70_000))
    assert datagram.record["step"] == 2
    assert datagram.dropped == 1  # the agent learns what it missed
    again.close()


def test_foreign_datagrams_are_ignored_and_the_receiver_goes_on(
    inbox: tuple[_Inbox, TelemetryReceiver],
) -> None:
    box, receiver = inbox
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.sendto(b"not json", receiver.path)
    raw.sendto(b'{"v": 99, "record": {"event": "x"}}', receiver.path)
    raw.close()
    assert len(decode_all(encode({"event": "step"}, durable=False, pid=1, dropped=0))) == 1
    TelemetrySender(receiver.path).send({"event": "step", "step": 3}, durable=True)
    assert [r["step"] for r, _ in box.wait_for(1)] == [3]


def test_a_worker_log_reports_to_its_agent_and_writes_no_file_of_its_own(
    inbox: tuple[_Inbox, TelemetryReceiver], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    box, receiver = inbox
    monkeypatch.setenv(env.TELEMETRY_SOCKET, receiver.path)
    monkeypatch.setenv(env.EVENTS_DIR, str(tmp_path))
    monkeypatch.setenv(env.RUN_ID, "exp-3")
    log = EventLog.from_env()
    log.record("step", round=2, step=7, duration_s=0.1, world=2, durable=False)
    log.record("step", round=2, step=7, duration_s=0.1, world=2)
    items = box.wait_for(2)
    assert [(r["job"], r["source"], r["step"], d) for r, d in items] == [
        ("exp-3", "worker", 7, False), ("exp-3", "worker", 7, True)]
    assert list(read_events(tmp_path)) == []


def test_without_an_agent_only_durable_records_reach_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(env.TELEMETRY_SOCKET, raising=False)
    monkeypatch.setenv(env.EVENTS_DIR, str(tmp_path))
    log = EventLog.from_env()
    log.record("step", step=1, durable=False)
    log.record("step", step=2)
    assert [e["step"] for e in read_events(tmp_path)] == [2]


def test_a_temporary_directory_too_deep_for_a_unix_socket_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    box = _Inbox()
    receiver = TelemetryReceiver(box).start()
    try:
        assert len(receiver.path) <= 100 and str(deep) not in receiver.path
        assert TelemetrySender(receiver.path).send({"event": "step", "step": 3}, durable=True)
        assert [r["step"] for r, _ in box.wait_for(1)] == [3]
    finally:
        receiver.stop()


def test_steps_are_coalesced_and_sent_without_a_flush_when_the_loop_stops_recording(
    inbox: tuple[_Inbox, TelemetryReceiver],
) -> None:
    box, receiver = inbox
    sender = TelemetrySender(receiver.path, coalesce_s=0.1)
    for step in range(5):
        assert not sender.send({"event": "step", "step": step}, durable=True, coalesce=True)
    assert sender.pending == 5 and sender.sent == 0
    # No flush and no further send: only the coalescing thread can send them (within
    # 1.5 x coalesce_s by design; how soon is the benchmarks' business).
    items = box.wait_for(5, timeout=30.0)
    assert [r["step"] for r, _ in items] == [0, 1, 2, 3, 4]
    assert sender.sent == 5 and sender.pending == 0


def test_any_other_record_takes_the_waiting_steps_along_in_order(
    inbox: tuple[_Inbox, TelemetryReceiver],
) -> None:
    box, _receiver = inbox
    sender = TelemetrySender(_receiver.path, coalesce_s=60.0)  # the thread would never send
    sender.send({"event": "step", "step": 1}, durable=True, coalesce=True)
    sender.send({"event": "step", "step": 1}, durable=False, coalesce=True)
    assert sender.send({"event": "checkpoint", "step": 2}, durable=True)
    items = box.wait_for(3)
    assert [(r["event"], d) for r, d in items] == [("step", True), ("step", False),
                                                   ("checkpoint", True)]


def test_a_batch_too_large_for_one_datagram_goes_in_pieces(
    inbox: tuple[_Inbox, TelemetryReceiver],
) -> None:
    box, _receiver = inbox
    sender = TelemetrySender(_receiver.path, coalesce_s=60.0)
    filler = "x" * 5000  # 20 of these are more than one datagram holds
    for step in range(20):
        sender.send({"event": "step", "step": step, "note": filler}, durable=True,
                    coalesce=True)
    sender.send_pending()
    assert [r["step"] for r, _ in box.wait_for(20)] == list(range(20))
    assert sender.dropped == 0


def test_a_batch_decodes_to_its_records_in_order() -> None:
    from elastic.telemetry import encode_batch

    payload = encode_batch([({"event": "step", "step": 1}, True),
                            ({"event": "step", "step": 1}, False)], pid=7, dropped=2)
    assert [(d.record["step"], d.durable, d.pid, d.dropped) for d in decode_all(payload)] == [
        (1, True, 7, 2), (1, False, 7, 2)]
    assert decode_all(b"not json") == []
