"""The goodput report's wall-time breakdown, membership changes and timeline picture."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from launch import goodput
from tests.unit.launch.test_goodput import (
    T0,
    events_dir,  # noqa: F401 - the shared fixture
)


def _report(directory: Path) -> goodput.Report:
    (job, events), = goodput.load(str(directory)).items()
    return goodput.build_report(job, events)


def test_the_parts_of_the_wall_time_add_up_and_match_the_log(events_dir: Path) -> None:  # noqa: F811
    report = _report(events_dir)
    parts = report.breakdown
    assert list(parts) == list(goodput.PARTS)
    assert sum(parts.values()) == pytest.approx(report.wall_s)
    assert parts["productive"] == pytest.approx(10.0)
    assert parts["recomputed"] == pytest.approx(1.0)
    assert parts["checkpoint"] == pytest.approx(0.25)
    assert parts["detection"] == pytest.approx(6.0 + 9.0)
    assert parts["rendezvous"] == pytest.approx(2.0 + 4.0 + 2.0)  # the start counts too
    assert parts["restore"] == pytest.approx(2.5 + 2.5 + 2.5)
    assert parts["other"] == pytest.approx(60.0 - 41.75)


def test_each_membership_change_splits_its_recovery(events_dir: Path) -> None:  # noqa: F811
    changes = _report(events_dir).changes
    assert [(c.round, c.reason, c.world_before, c.world_after) for c in changes] == [
        (1, "planned_departure", 3, 3), (2, "node_lost", 3, 3)]
    first, second = changes
    # Last step of round 0 ends at +14; b's notice at +20; round 1 at +24; its first step
    # starts at +26.5.
    assert (first.at, first.detection_s, first.rendezvous_s, first.restore_s) == (
        14.0, 6.0, 4.0, 2.5)
    assert first.recovery_s == pytest.approx(12.5)
    assert (second.detection_s, second.rendezvous_s, second.restore_s) == (9.0, 2.0, 2.5)


def test_the_timeline_merges_steps_and_is_in_json(
    events_dir: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    assert goodput.main([str(events_dir), "--json"]) == 0
    (data,) = json.loads(capsys.readouterr().out)
    kinds = [kind for _, _, kind in data["timeline"]]
    assert kinds.count("productive") == 20  # steps here are 0.5 s apart: not merged
    merged = goodput._merge([(0.0, 1.0, "productive"), (1.1, 2.0, "productive"),
                             (3.0, 4.0, "productive"), (3.5, 3.6, "checkpoint")])
    assert merged == [(0.0, 2.0, "productive"), (3.0, 4.0, "productive"),
                      (3.5, 3.6, "checkpoint")]
    assert {"detection", "rendezvous", "restore", "checkpoint", "recomputed"} <= set(kinds)
    assert data["breakdown"]["productive"] == pytest.approx(10.0)
    assert [c["round"] for c in data["changes"]] == [1, 2]
    assert data["worlds"][0] == [4.5 + 0.5, 3]


def test_the_plot_command_writes_a_real_png(events_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from matplotlib import image

    out = tmp_path / "timeline.png"
    assert goodput.main([str(events_dir), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(str(out))
    height, width = pixels.shape[:2]
    assert width > 800 and height > 300
    colors = {tuple(round(float(c), 2) for c in px[:3]) for px in pixels[::7, ::7].reshape(-1,
                                                                                        pixels.shape[2])}
    assert len(colors) > 10, "the picture is (nearly) blank"


def test_plotting_a_directory_of_several_jobs_needs_a_job_id(
    events_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
) -> None:
    other = (events_dir / "a.jsonl").read_text().replace('"job": "exp"', '"job": "exp2"')
    (events_dir / "z.jsonl").write_text(other)
    assert goodput.main([str(events_dir), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pass --job ID" in capsys.readouterr().err
    assert goodput.main([str(events_dir), "--job", "exp", "--plot",
                         str(tmp_path / "x.png")]) == 0


def test_wall_time_counts_from_the_agent_process_start_where_logged(
    events_dir: Path,  # noqa: F811
) -> None:
    path = events_dir / "a.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    first = next(e for e in lines if e["event"] == "agent_started")
    first["launched_at"] = first["time"] - 4.0  # python and torch imported for 4 s
    path.write_text("\n".join(json.dumps(e) for e in lines) + "\n")
    report = _report(events_dir)
    assert report.wall_s == pytest.approx(64.0)
    assert sum(report.breakdown.values()) == pytest.approx(64.0)


def test_a_process_start_time_is_read_from_proc() -> None:
    import os
    import time

    from elastic.eventlog import process_started_at

    started = process_started_at()
    assert started is not None and 0 <= time.time() - started < 3600
    assert process_started_at(os.getpid()) == started
    assert process_started_at(2**22 + 12345) is None  # no such process


def _in_place_job(directory: Path, agent_events: list[tuple[float, str, dict[str, Any]]],
                  worlds: list[tuple[float, int, int]],
                  worker_events: Sequence[dict[str, Any]] = ()) -> goodput.Report:
    """Writes one agent's events and rank 0's steps ``(time, world epoch, world size)``."""
    agent = [{"time": T0 + t, "source": "agent", "node": "a/1", "event": kind, **fields}
             for t, kind, fields in agent_events]
    steps = [{"time": T0 + t, "source": "worker", "node": "a/1", "event": "step",
              "round": epoch, "step": i, "duration_s": 0.5, "world": world}
             for i, (t, epoch, world) in enumerate(worlds)]
    (directory / "a.jsonl").write_text("\n".join(
        json.dumps({"v": 1, "job": "exp", "round": None, **e})
        for e in agent + steps + list(worker_events)) + "\n")
    return _report(directory)


def test_in_place_changes_are_matched_by_time_and_named_by_what_was_seen(
    tmp_path: Path,
) -> None:
    # In place the workers label steps with their world epoch (7, 8, 9), not the agent round.
    report = _in_place_job(tmp_path, [
        (0, "agent_started", {}),
        (1, "round_started", {"round": 0, "world": 3, "reason": "start"}),
        (11, "node_lost", {"round": 0, "ranks": [2]}),
        (12, "round_started", {"round": 1, "world": 2, "reason": "node_joined"}),
        (40, "agent_exited", {"outcome": "succeeded", "exit_code": 0}),
    ], [(2 + k, 7, 3) for k in range(8)] + [(13 + k, 8, 2) for k in range(8)]
        + [(24 + k, 9, 3) for k in range(8)])
    assert [(c.round, c.reason, c.world_before, c.world_after) for c in report.changes] == [
        (8, "node_lost", 3, 2), (9, "node_joined", 2, 3)]
    lost, joined = report.changes
    assert (lost.detection_s, lost.rendezvous_s, lost.restore_s) == (2.0, 1.0, 0.5)
    assert (joined.detection_s, joined.rendezvous_s, joined.restore_s) == (0.0, 0.0, 3.5)
    assert sum(report.breakdown.values()) == pytest.approx(report.wall_s)


def test_an_exiting_agent_writes_the_summary_as_json_and_text(
    events_dir: Path, tmp_path: Path,  # noqa: F811
) -> None:
    import io

    out = io.StringIO()
    report = goodput.write_summary(str(events_dir), "exp", out=out)
    assert report is not None and report.finished
    saved = json.loads((events_dir / "exp.goodput.json").read_text())
    assert saved["breakdown"] == report.breakdown and saved["goodput"] == report.goodput
    assert "wall time by part" in out.getvalue() and "--plot timeline.png" in out.getvalue()
    assert len(goodput.load(str(events_dir))) == 1  # the JSON is not read back as events
    assert goodput.write_summary(str(events_dir), "other", out=out) is None
    assert goodput.write_summary(str(tmp_path / "missing"), "exp", out=out) is None


def test_a_failure_the_workers_recover_from_before_any_agent_notices_is_named_by_them(
    tmp_path: Path,
) -> None:
    # In place a lost node's worker is known dead from its closed liveness port within a
    # step: the survivors record peer_failed and train on; the agents see nothing in time.
    failed = {"time": T0 + 9.25, "source": "worker", "node": "a/1", "event": "peer_failed",
              "round": 7, "step": 8, "error": "Connection closed by peer"}
    report = _in_place_job(tmp_path, [
        (0, "agent_started", {}),
        (1, "round_started", {"round": 0, "world": 3, "reason": "start"}),
        (20, "agent_exited", {"outcome": "succeeded", "exit_code": 0}),
    ], [(2 + k, 7, 3) for k in range(8)] + [(10.5 + k, 8, 2) for k in range(8)], [failed])
    (change,) = report.changes
    assert (change.reason, change.world_before, change.world_after) == ("peer_failed", 3, 2)
    # Detection: last step end (9) to the failure (9.25); no agent round: the rest is restore.
    assert (change.detection_s, change.rendezvous_s, change.restore_s) == (0.25, 0.0, 0.75)
