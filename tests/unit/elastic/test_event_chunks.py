"""The chunked event log writer and reader on real fsspec filesystems (local disk, memory).

The same writer on moto's S3 server, and a writer SIGKILLed mid-run, are tested in
``tests/integration/test_events_on_s3.py``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest

from elastic.event_chunks import ChunkWriter, read_texts
from elastic.eventlog import EventLog, read_events


def _record(i: int, job: str = "exp") -> dict[str, Any]:
    return {"v": 1, "time": 1000.0 + i, "job": job, "source": "agent", "node": "h/1",
            "round": None, "event": "step", "step": i}


def _steps(location: str) -> list[int]:
    return sorted(e["step"] for e in read_events(location))


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*.jsonl"))


def test_each_flush_puts_a_new_chunk_and_only_durable_records(tmp_path: Path) -> None:
    writer = ChunkWriter(str(tmp_path), "exp/1", flush_interval_s=60)
    for i in range(3):
        writer.write(_record(i), durable=True)
    writer.write(_record(99), durable=False)  # live telemetry only
    assert writer.flush(5)
    for i in range(3, 5):
        writer.write(_record(i), durable=True)
    assert writer.flush(5)
    writer.close(5)
    directory = tmp_path / "exp_1" / writer.writer
    assert _names(directory) == ["c0000000000.jsonl", "c0000000001.jsonl"]
    assert _steps(str(tmp_path)) == [0, 1, 2, 3, 4]


def test_records_are_put_within_the_flush_interval_without_a_flush_call(tmp_path: Path) -> None:
    writer = ChunkWriter(str(tmp_path), "exp", flush_interval_s=0.05)
    writer.write(_record(1), durable=True)
    deadline = time.monotonic() + 10
    while not _steps(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _steps(str(tmp_path)) == [1]
    writer.close(5)


def test_chunks_are_rolled_up_into_segments_and_read_once(tmp_path: Path) -> None:
    writer = ChunkWriter(str(tmp_path), "exp", flush_interval_s=60, rollup=3)
    for i in range(7):
        writer.write(_record(i), durable=True)
        assert writer.flush(5)
    writer.close(5)
    assert _names(tmp_path) == ["c0000000006.jsonl", "s0000000000-0000000002.jsonl",
                                "s0000000003-0000000005.jsonl"]
    assert _steps(str(tmp_path)) == list(range(7))


def test_a_writer_killed_between_its_segment_and_the_deletes_leaves_no_duplicates(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "exp" / "host.1.abc"
    directory.mkdir(parents=True)
    lines = [json.dumps(_record(i)) for i in range(3)]
    for i, line in enumerate(lines):
        (directory / f"c{i:010d}.jsonl").write_text(line + "\n")
    (directory / "s0000000000-0000000001.jsonl").write_text("\n".join(lines[:2]) + "\n")
    assert _steps(str(tmp_path)) == [0, 1, 2]


def test_several_writers_of_one_job_never_share_an_object(tmp_path: Path) -> None:
    writers = [ChunkWriter(str(tmp_path), "exp", flush_interval_s=60) for _ in range(3)]
    for n, writer in enumerate(writers):
        writer.write(_record(n), durable=True)
        writer.close(5)
    assert len({w.writer for w in writers}) == 3
    assert len(list((tmp_path / "exp").iterdir())) == 3
    assert _steps(str(tmp_path)) == [0, 1, 2]


def test_the_old_per_process_files_and_the_chunks_are_read_together(tmp_path: Path) -> None:
    legacy = EventLog(tmp_path, job="exp", source="agent")
    legacy.record("agent_started")
    writer = ChunkWriter(str(tmp_path), "exp", flush_interval_s=60)
    writer.write(_record(5), durable=True)
    writer.close(5)
    assert sorted(e["event"] for e in read_events(tmp_path)) == ["agent_started", "step"]


class _Flaky:
    """Makes a filesystem's puts fail ``failures`` times with ``error``."""

    def __init__(self, fs: Any, failures: int, error: Exception) -> None:
        self.fs, self.failures, self.error, self.calls = fs, failures, error, 0
        self.real = fs.pipe_file

    def __call__(self, path: str, data: bytes, **kwargs: Any) -> None:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        self.real(path, data, **kwargs)


def _memory_url() -> str:
    return f"memory://events-{uuid.uuid4().hex[:8]}"


def test_transient_errors_are_retried_and_nothing_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _memory_url()
    writer = ChunkWriter(url, "exp", flush_interval_s=60)
    flaky = _Flaky(writer._fs, 3, ConnectionError("reset by peer"))
    monkeypatch.setattr(writer._fs, "pipe_file", flaky)  # the memory fs is shared: undone
    for i in range(4):
        writer.write(_record(i), durable=True)
    assert writer.flush(20)
    writer.close(5)
    assert flaky.calls == 4 and _steps(url) == [0, 1, 2, 3]


def test_an_outage_longer_than_the_deadline_keeps_records_for_the_next_flush(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _memory_url()
    writer = ChunkWriter(url, "exp", flush_interval_s=0.05, retry_deadline_s=0.1,
                         max_buffered=10)
    flaky = _Flaky(writer._fs, 10**9, TimeoutError("read timed out"))
    monkeypatch.setattr(writer._fs, "pipe_file", flaky)
    with caplog.at_level(logging.WARNING):
        for i in range(25):
            writer.write(_record(i), durable=True)
            time.sleep(0.01)
        assert not writer.flush(0.3)
        flaky.failures = 0  # storage is back
        assert writer.flush(20)
    writer.close(5)
    steps = _steps(url)
    # The chunk cut before the outage is kept whole; the buffer behind it kept its newest 10.
    assert steps[-10:] == list(range(15, 25))
    assert len(steps) + writer.dropped == 25
    assert caplog.text.count("Cannot write the event log") == 1
    assert "writable again" in caplog.text


def test_a_permanent_error_turns_the_log_off_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _memory_url()
    writer = ChunkWriter(url, "exp", flush_interval_s=60)
    monkeypatch.setattr(writer._fs, "pipe_file",
                        _Flaky(writer._fs, 10**9, PermissionError("Access Denied")))
    with caplog.at_level(logging.ERROR):
        writer.write(_record(1), durable=True)
        assert not writer.flush(5)
        writer.write(_record(2), durable=True)
    writer.close(5)
    assert writer.failed and not writer.enabled and writer.dropped == 1
    assert caplog.text.count("events are off") == 1
    assert list(read_texts(url)) == []


def test_an_event_log_on_a_url_writes_chunks_and_reads_back() -> None:
    url = _memory_url()
    log = EventLog(url, job="exp", source="agent", node="h/1")
    log.record("agent_started", launched_at=None)
    log.record("step", step=0, duration_s=0.1, world=1, durable=False)
    log.close()
    assert [e["event"] for e in read_events(url)] == ["agent_started"]
    assert log.path is None
    fs = fsspec.filesystem("memory")
    assert any(p.endswith("c0000000000.jsonl") for p in fs.find(url.removeprefix("memory:/")))


def test_an_unknown_scheme_is_reported_and_the_job_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR):
        log = EventLog("nosuchscheme://bucket/events", job="exp", source="agent")
        log.record("agent_started")
    assert not log.enabled
    assert "nosuchscheme://bucket/events" in caplog.text
