"""The node's Prometheus series as a projection of its event records, read back as Prometheus
text (and over HTTP), checked against the goodput report of the same records."""

from __future__ import annotations

import socket
import urllib.request
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic.errors import ConfigError
from launch.goodput import build_report
from launch.metrics import NodeMetrics

T0 = 1_700_000_000.0
JOB, NODE = "exp", "host-a/42"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("job_id", "node")))
            out[(s.name, labels)] = s.value
    return out


def _read(metrics: NodeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return _samples(generate_latest(metrics.registry).decode())


def _agent(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "time": T0 + t, "job": JOB, "source": "agent", "node": NODE,
            "round": fields.pop("round", None), "event": event, **fields}


def _worker(t: float, event: str, round_: Any, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "time": T0 + t, "job": JOB, "source": "worker", "node": NODE,
            "round": round_, "event": event, **fields}


def _steps(round_: Any, first: int, last: int, start: float, world: int,
           duration: float = 0.4) -> list[dict[str, Any]]:
    return [_worker(start + 0.5 * i, "step", round_, step=s, duration_s=duration, world=world)
            for i, s in enumerate(range(first, last + 1))]


def _feed(metrics: NodeMetrics, records: list[tuple[dict[str, Any], bool]]) -> None:
    for record, durable in records:
        metrics.write(record, durable)


def _restart_job() -> list[tuple[dict[str, Any], bool]]:
    """One node, two workers each reporting every step (rank 0's durable): a crash at +6.2,
    round 1 restores step 5 (steps 5-9 redone)."""
    out: list[tuple[dict[str, Any], bool]] = [
        (_agent(0, "agent_started", launched_at=T0 - 1.0), True),
        (_agent(0.5, "round_started", round=0, group_rank=0, world=1, reason="start"), True),
        (_agent(0.6, "workers_started", round=0, workers=2, restart=False), True),
        (_worker(1.0, "restored", 0, step=0, found=False, duration_s=0.01), True),
    ]
    for record in _steps(0, 0, 9, 1.5, 2):
        out += [(record, True), (dict(record), False)]  # rank 0 and rank 1
    out += [
        (_worker(3.0, "checkpoint", 0, step=5, blocked_s=0.02, final=False), True),
        (_worker(3.1, "checkpoint_staged", 0, step=5, bytes=1 << 20, stage_s=0.001,
                 copy_s=0.05, held_s=0.03, stall_s=0.032), True),
        (_worker(3.1, "checkpoint_staged", 0, step=5, bytes=1 << 20, stage_s=0.001,
                 copy_s=0.05, held_s=0.031, stall_s=0.033), False),
        (_worker(3.2, "checkpoint_deferred", 0, step=6,
                 reason="the save of step 5 is still being written"), True),
        (_worker(3.5, "checkpoint_committed", 0, step=5, durable_s=0.3, world=2), True),
        (_worker(3.5, "checkpoint_committed", 0, step=5, durable_s=0.31, world=2), False),
        (_worker(5.6, "checkpoint_failed", 0, step=10, error="disk full"), True),
        (_agent(6.2, "worker_failed", round=0, exit_codes={"1": -9}, cause="crash"), True),
        (_agent(7.0, "round_started", round=1, group_rank=0, world=1, reason="worker_failed"),
         True),
        (_agent(7.1, "workers_started", round=1, workers=2, restart=True), True),
        (_worker(8.0, "restored", 1, step=5, found=True, duration_s=0.25), True),
    ]
    for record in _steps(1, 5, 12, 9.0, 2):
        out += [(dict(record), False), (record, True)]
    return out


def test_each_step_counts_once_whatever_the_number_of_workers_that_report_it() -> None:
    metrics = NodeMetrics(job=JOB, node=NODE)
    _feed(metrics, _restart_job())
    got = _read(metrics)
    assert got[("elastic_run_steps_total", ())] == 10 + 8
    assert got[("elastic_run_step_seconds_count", ())] == 18
    assert got[("elastic_run_world_size", ())] == 2
    assert got[("elastic_run_last_step", ())] == 12
    assert got[("elastic_run_nodes", ())] == 1
    assert got[("elastic_run_events_total", (("event", "step"),))] == 36  # every record


def test_a_change_is_counted_and_split_exactly_as_the_goodput_report_splits_it() -> None:
    records = _restart_job()
    metrics = NodeMetrics(job=JOB, node=NODE)
    _feed(metrics, records)
    got = _read(metrics)
    report = build_report(JOB, sorted((r for r, durable in records if durable),
                                      key=lambda e: e["time"]))
    (change,) = report.changes
    assert change.reason == "worker_failed"
    kinds = {dict(labels)["kind"]: v for (name, labels), v in got.items()
             if name == "elastic_run_membership_changes_total"}
    assert kinds == {"planned_departure": 0, "node_lost": 0, "worker_failed": 1,
                     "peer_failed": 0, "node_joined": 0, "node_left": 0, "world_changed": 0}
    for part, expected in (("detection", change.detection_s),
                           ("rendezvous", change.rendezvous_s),
                           ("restore", change.restore_s), ("total", change.recovery_s)):
        assert got[("elastic_run_recovery_seconds_count", (("part", part),))] == 1
        assert got[("elastic_run_recovery_seconds_sum", (("part", part),))] == pytest.approx(
            expected, abs=2e-3)
    assert got[("elastic_run_steps_redone_total", ())] == report.recomputed_steps == 5


def test_checkpoint_restart_and_failure_series() -> None:
    metrics = NodeMetrics(job=JOB, node=NODE)
    _feed(metrics, _restart_job())
    got = _read(metrics)
    assert got[("elastic_run_checkpoint_blocking_seconds_count", ())] == 1
    assert got[("elastic_run_checkpoint_blocking_seconds_sum", ())] == pytest.approx(0.02)
    assert got[("elastic_run_checkpoint_durable_seconds_count", ())] == 1  # both ranks: once
    assert got[("elastic_run_checkpoint_stall_seconds_count", ())] == 1  # both ranks: once
    assert got[("elastic_run_checkpoint_stall_seconds_sum", ())] == pytest.approx(0.032)
    assert got[("elastic_run_checkpoint_deferred_total", ())] == 1
    assert got[("elastic_run_checkpoint_durable_seconds_sum", ())] == pytest.approx(0.3)
    assert got[("elastic_run_checkpoint_failures_total", ())] == 1
    assert got[("elastic_run_checkpoint_load_seconds_count", ())] == 1  # the fresh start: none
    assert got[("elastic_run_checkpoint_last_committed_step", ())] == 5
    assert got[("elastic_run_worker_restarts_total", ())] == 2
    assert got[("elastic_run_worker_failures_total", (("cause", "crash"),))] == 1


def test_goodput_so_far_is_productive_step_time_over_time_since_the_agent_started() -> None:
    now = [T0 + 20.0]
    metrics = NodeMetrics(job=JOB, node=NODE, clock=lambda: now[0])
    records = _restart_job()
    _feed(metrics, records)
    report = build_report(JOB, sorted((r for r, d in records if d), key=lambda e: e["time"]))
    assert report.productive_s is not None
    got = _read(metrics)
    # Since the agent's process start (launched_at), as the report's wall time.
    assert got[("elastic_run_goodput_ratio", ())] == pytest.approx(
        report.productive_s / 21.0, rel=1e-6)


def test_in_place_a_survivor_counts_the_loss_and_then_the_replacement_joining() -> None:
    metrics = NodeMetrics(job=JOB, node=NODE)
    records = [(_agent(0, "agent_started", launched_at=None), True)]
    records += [(r, True) for r in _steps(0, 0, 5, 1.0, 3)]
    records += [(_worker(4.0, "peer_failed", 0, step=6, error="Connection closed"), True)]
    records += [(r, True) for r in _steps(1, 6, 8, 4.5, 2)]
    records += [(r, True) for r in _steps(2, 9, 12, 7.0, 3)]
    records += [(_steps(1, 8, 8, 6.0, 2)[0], True)]  # a sibling's late copy of epoch 1
    _feed(metrics, records)
    got = _read(metrics)
    assert got[("elastic_run_membership_changes_total", (("kind", "peer_failed"),))] == 1
    assert got[("elastic_run_membership_changes_total", (("kind", "node_joined"),))] == 1
    assert got[("elastic_run_recovery_seconds_count", (("part", "total"),))] == 2
    assert got[("elastic_run_steps_redone_total", ())] == 0
    assert got[("elastic_run_world_size", ())] == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_served_over_http_as_prometheus_text() -> None:
    metrics = NodeMetrics(job=JOB, node=NODE)
    port = metrics.serve(0, "127.0.0.1")
    try:
        _feed(metrics, _restart_job())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        got = _samples(text)
        assert got[("elastic_run_steps_total", ())] == 18
        assert 'job_id="exp"' in text and 'node="host-a/42"' in text
    finally:
        metrics.close(0)


def test_a_port_in_use_is_bad_input_naming_the_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"--metrics-port \({port}\)"):
            NodeMetrics(job=JOB, node=NODE).serve(port, "127.0.0.1")


def test_an_agent_logs_rank_zeros_records_and_counts_its_reporters_steps(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic import env
    from elastic.eventlog import EventLog, read_events
    from launch.telemetry import NodeTelemetry

    events = EventLog(tmp_path, job=JOB, source="agent", node=NODE)
    telemetry = NodeTelemetry(events, metrics_port=0, metrics_host="127.0.0.1").start()
    try:
        monkeypatch.setenv(env.RUN_ID, JOB)
        for name, value in telemetry.worker_env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("LOCAL_RANK", "1")  # a second worker of the node, global rank 1
        other = EventLog.from_env()
        monkeypatch.setenv("LOCAL_RANK", "0")  # the node's reporter, global rank 0
        reporter = EventLog.from_env()
        for step in range(5):
            reporter.record("step", round=0, step=step, duration_s=0.01, world=2)
            other.record("step", round=0, step=step, duration_s=0.01, world=2, durable=False)
        reporter.flush(1.0)  # what a worker's loop does at its end (steps are coalesced)
    finally:
        telemetry.close()  # takes what is still queued on the socket
        events.close()
    assert telemetry.metrics is not None and telemetry.receiver is not None
    got = _read(telemetry.metrics)
    assert got[("elastic_run_steps_total", ())] == 5
    assert telemetry.receiver.received == 5  # the other worker sent nothing to repeat
    logged = [e["step"] for e in read_events(tmp_path) if e["event"] == "step"]
    assert logged == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("batch", [1, 3, 8, 1000])
def test_records_in_batches_give_the_series_they_give_one_by_one(batch: int) -> None:
    clock = lambda: T0 + 20.0  # noqa: E731 - the goodput gauge reads it
    records = _restart_job()
    one_by_one = NodeMetrics(job=JOB, node=NODE, clock=clock)
    _feed(one_by_one, records)
    batched = NodeMetrics(job=JOB, node=NODE, clock=clock)
    for first in range(0, len(records), batch):
        batched.write_many(records[first:first + batch])
    def values(metrics: NodeMetrics) -> dict[Any, float]:  # *_created: when, not what
        return {k: v for k, v in _read(metrics).items() if not k[0].endswith("_created")}

    assert values(batched) == values(one_by_one)
    assert values(batched)[("elastic_run_last_step", ())] == 12
