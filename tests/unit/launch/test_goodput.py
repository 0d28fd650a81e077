"""The goodput report, from a hand-written event log of a job with every kind of change."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launch import goodput

T0 = 1_700_000_000.0


def _write(directory: Path, name: str, events: list[dict[str, Any]]) -> None:
    lines = [json.dumps({"v": 1, "job": "exp", "round": None, **e}) for e in events]
    (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def _agent(node: str, *events: tuple[float, str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"time": T0 + t, "source": "agent", "node": node, "event": kind, **fields}
            for t, kind, fields in events]


def _steps(node: str, round_: int, first: int, last: int, start: float) -> list[dict[str, Any]]:
    return [{"time": T0 + start + i, "source": "worker", "node": node, "event": "step",
             "round": round_, "step": s, "duration_s": 0.5, "world": 3}
            for i, s in enumerate(range(first, last + 1))]


@pytest.fixture
def events_dir(tmp_path: Path) -> Path:
    # Round 0: a, b, c. At +20 b is preempted (planned); round 1: a, c. At +40 c vanishes;
    # round 2: a alone re-does steps 14-15 (rolled back to a checkpoint) and finishes.
    _write(tmp_path, "a", _agent(
        "a/1",
        (0, "agent_started", {}),
        (2, "round_started", {"round": 0, "group_rank": 0, "world": 3, "reason": "start"}),
        (20.5, "peer_departed", {"round": 0, "ranks": [1]}),
        (22, "worker_failed", {"round": 0, "exit_codes": {"0": 143},
                               "cause": "planned_departure"}),
        (24, "round_started", {"round": 1, "group_rank": 0, "world": 2,
                               "reason": "planned_departure"}),
        (41, "node_lost", {"round": 1, "ranks": [1]}),
        (43, "round_started", {"round": 2, "group_rank": 0, "world": 1, "reason": "node_lost"}),
        (60, "job_finished", {"round": 2}),
        (60, "agent_exited", {"round": 2, "outcome": "succeeded", "exit_code": 0}),
    ))
    _write(tmp_path, "b", _agent(
        "b/2",
        (1, "agent_started", {}),
        (2, "round_started", {"round": 0, "group_rank": 1, "world": 3, "reason": "start"}),
        (20, "planned_departure", {"round": 0, "notice": "gcp", "deadline": None}),
        (23, "left_rendezvous", {"round": 0, "drained": True, "exit_codes": {"1": 143}}),
        (23, "agent_exited", {"round": 0, "outcome": "departed", "exit_code": 0}),
    ))
    _write(tmp_path, "c", _agent(
        "c/3",
        (1, "agent_started", {}),
        (2, "round_started", {"round": 0, "group_rank": 2, "world": 3, "reason": "start"}),
        (24, "round_started", {"round": 1, "group_rank": 1, "world": 2,
                               "reason": "planned_departure"}),
        (30, "worker_failed", {"round": 1, "exit_codes": {"1": 1}, "cause": "crash"}),
    ))
    _write(tmp_path, "w", [
        *_steps("a/1", 0, 0, 9, 5), *_steps("a/1", 1, 10, 15, 27),
        *_steps("a/1", 2, 14, 19, 46),
        {"time": T0 + 30.5, "source": "worker", "node": "a/1", "event": "checkpoint",
         "round": 1, "step": 12, "blocked_s": 0.25, "final": False},
    ])
    (tmp_path / "partial.jsonl").write_text('{"time": 1, "ev')  # a file being written
    return tmp_path


def test_productive_time_counts_each_step_once_and_redone_steps_as_recomputed(
    events_dir: Path,
) -> None:
    (job, events), = goodput.load(str(events_dir)).items()
    report = goodput.build_report(job, events)
    assert report.finished and report.wall_s == pytest.approx(60.0)
    assert report.steps == 20 and report.productive_s == pytest.approx(10.0)
    assert (report.recomputed_steps, report.recomputed_s) == (2, pytest.approx(1.0))
    assert report.checkpoint_s == pytest.approx(0.25)
    assert report.goodput == pytest.approx(10.0 / 60.0)


def test_rounds_carry_their_reason_world_and_recovery(events_dir: Path) -> None:
    (job, events), = goodput.load(str(events_dir)).items()
    rounds = goodput.build_report(job, events).rounds
    assert [(r.round, r.world, r.reason) for r in rounds] == [
        (0, 3, "start"), (1, 2, "planned_departure"), (2, 1, "node_lost")]
    assert rounds[0].recovery_s is None
    assert rounds[1].recovery_s == pytest.approx(27.0 - 14.0)  # last step of 0 -> first of 1
    assert rounds[2].recovery_s == pytest.approx(46.0 - 32.0)


def test_planned_departures_are_told_apart_from_failures(events_dir: Path) -> None:
    (job, events), = goodput.load(str(events_dir)).items()
    report = goodput.build_report(job, events)
    assert [(d.node, d.planned, d.cause, d.drained, d.round) for d in report.departures] == [
        ("b/2", True, "gcp", True, 0), ("c/3", False, "node_lost", None, 1)]
    crashes = [f for f in report.worker_failures if f["cause"] == "crash"]
    assert [(f["node"], f["exit_codes"]) for f in crashes] == [("c/3", {"1": 1})]


def test_the_command_prints_text_and_json(
    events_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert goodput.main([str(events_dir)]) == 0
    text = capsys.readouterr().out
    assert "job exp: finished" in text and "goodput 0.167" in text
    assert "b/2  round 0  planned (gcp notice, workers drained)" in text
    assert "c/3  round 1  failure (node_lost)" in text
    assert goodput.main([str(events_dir), "--json", "--job", "exp"]) == 0
    (data,) = json.loads(capsys.readouterr().out)
    assert data["goodput"] == pytest.approx(1 / 6) and len(data["departures"]) == 2


def test_without_step_events_goodput_is_unknown(tmp_path: Path) -> None:
    _write(tmp_path, "a", _agent("a/1", (0, "agent_started", {}),
                                 (5, "agent_exited", {"outcome": "failed", "exit_code": 1})))
    (job, events), = goodput.load(str(tmp_path)).items()
    report = goodput.build_report(job, events)
    assert report.productive_s is None and report.goodput is None and not report.finished
    assert "goodput unknown" in goodput.format_report(report)


def test_an_empty_directory_or_unknown_job_is_bad_input(
    events_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert goodput.main([str(empty)]) == 2
    assert goodput.main([str(events_dir), "--job", "other"]) == 2
    assert "no events of job 'other'" in capsys.readouterr().err
