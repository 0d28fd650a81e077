"""The job event log: one file per process, one JSON object per line, never raising."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

import pytest

from elastic import env
from elastic.eventlog import FORMAT_VERSION, EventLog, node_id, read_events


def test_each_event_is_one_json_line_with_the_envelope(tmp_path: Path) -> None:
    log = EventLog(tmp_path, job="exp-1", source="agent", node="host-a/42")
    log.record("round_started", round=3, group_rank=1, world=2, reason="start")
    log.record("job_finished")
    assert log.path is not None and log.path.parent == tmp_path
    lines = log.path.read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first == {**first, "v": FORMAT_VERSION, "job": "exp-1", "source": "agent",
                     "node": "host-a/42", "round": 3, "event": "round_started",
                     "group_rank": 1, "world": 2, "reason": "start"}
    assert second["round"] is None and second["event"] == "job_finished"
    assert first["time"] <= second["time"]


def test_an_event_field_cannot_overwrite_the_envelope(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = EventLog(tmp_path, job="j", source="agent")
    with caplog.at_level(logging.WARNING):
        log.record("planned_departure", source="aws", notice="aws")
    (event,) = read_events(tmp_path)
    assert event["source"] == "agent" and event["notice"] == "aws"
    assert "source" in caplog.text


def test_agents_and_workers_write_files_of_their_own_and_are_read_together(
    tmp_path: Path,
) -> None:
    agent = EventLog(tmp_path, job="j/1", source="agent")
    worker = EventLog(tmp_path, job="j/1", source="worker")
    agent.record("agent_started")
    worker.record("step", round=0, step=0, duration_s=0.1, world=1)
    assert agent.path != worker.path
    assert "/" not in (agent.path.name if agent.path else "/")  # job ids become safe names
    assert sorted(e["event"] for e in read_events(tmp_path)) == ["agent_started", "step"]


def test_a_partial_or_foreign_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "j.agent.h.1.jsonl"
    path.write_text('{"time": 1.0, "event": "agent_started"}\n[1, 2]\n{"time": 2.0, "ev')
    assert [e["event"] for e in read_events(tmp_path)] == ["agent_started"]


def test_no_directory_means_no_log() -> None:
    log = EventLog(None, job="j", source="agent")
    log.record("agent_started")
    assert not log.enabled and log.path is None


def test_an_unwritable_directory_is_reported_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = EventLog(blocker / "events", job="j", source="agent")
    with caplog.at_level(logging.WARNING):
        log.record("agent_started")
        log.record("job_finished")
    assert not log.enabled
    assert caplog.text.count("Cannot write the event log") == 1


def test_a_worker_takes_directory_job_and_agent_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.EVENTS_DIR, str(tmp_path))
    monkeypatch.setenv(env.RUN_ID, "exp-9")
    monkeypatch.setenv(env.AGENT_PID, "4242")
    log = EventLog.from_env()
    log.record("step", round=1, step=5, duration_s=0.2, world=2)
    (event,) = read_events(tmp_path)
    assert (event["job"], event["source"], event["node"]) == (
        "exp-9", "worker", f"{socket.gethostname()}/4242")
    assert node_id() == f"{socket.gethostname()}/{os.getpid()}"
