"""Formatting of ``elastic-run status`` output."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from launch.status import format_health, format_status, main, metrics_targets, node_health


@dataclass(frozen=True)
class _Member:
    node_id: str
    host: str
    pid: int
    started_at: float
    auth_token: str = "s3cr3t"


@dataclass(frozen=True)
class _Status:
    round: int
    world_size: int
    members: tuple[_Member, ...]


def test_status_shows_round_world_members_and_ages_but_no_credentials() -> None:
    status = _Status(round=7, world_size=2, members=(
        _Member("b", "10.0.0.2", 22, started_at=990.0), _Member("a", "10.0.0.1", 11, 900.0),
    ))
    text = format_status("job-1", status, now=1000.0)
    lines = text.splitlines()
    assert lines[0] == "job job-1: round 7, world size 2, 2 member(s)"
    assert lines[1] == "  - node_id=a host=10.0.0.1 pid=11 started age=100.0 s"
    assert lines[2] == "  - node_id=b host=10.0.0.2 pid=22 started age=10.0 s"
    assert "s3cr3t" not in text


def test_unknown_job_says_so() -> None:
    assert format_status("nope", None) == (
        "job nope: no rendezvous state found (not started, or expired)."
    )


def test_status_without_endpoints_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASTIC_ETCD_ENDPOINTS", raising=False)
    assert main(["--job-id", "x"]) == 2
    assert "no etcd endpoint given" in capsys.readouterr().err


def test_an_unknown_job_is_an_error_naming_the_job_id(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import launch.status as status

    monkeypatch.setattr(status, "_read", lambda *args: None)
    assert main(["--job-id", "nope", "--etcd", "127.0.0.1:2379"]) == status.EXIT_NOT_FOUND
    err = capsys.readouterr().err
    assert err.startswith("elastic-run: error: job (nope) has no live member in etcd "
                          "(127.0.0.1:2379); check --job-id")


def test_a_round_that_lost_a_member_says_so() -> None:
    status = _Status(round=3, world_size=1, members=(_Member("a", "h", 1, 0.0),))
    text = format_status("j", {**status.__dict__, "expected_size": 2}, now=1.0)
    assert text.splitlines()[0] == (
        "job j: round 3, world size 1 (formed with 2: a node was lost), 1 member(s)"
    )


# -- the live part: real metrics endpoints (in-process exporters) -------------------------------

def _serving_node(name: str, steps: int) -> tuple[Any, str]:
    from launch.metrics import NodeMetrics

    metrics = NodeMetrics(job="j", node=name)
    port = metrics.serve(0, "127.0.0.1")
    for step in range(steps):
        metrics.write({"time": time.time(), "event": "step", "round": 0, "step": step,
                       "duration_s": 0.01, "world": 2, "source": "worker"}, True)
    metrics.write({"time": time.time(), "event": "checkpoint_committed", "round": 0,
                   "step": 10, "durable_s": 0.2, "source": "worker"}, True)
    return metrics, f"http://127.0.0.1:{port}/metrics"


def test_live_health_scrapes_every_node_and_shows_an_unreachable_one() -> None:
    busy, busy_url = _serving_node("host-a/1", 12)
    idle, idle_url = _serving_node("host-b/2", 12)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}/metrics"
    stop = threading.Event()

    def train() -> None:  # host-a keeps completing steps while status measures
        step = 12
        while not stop.wait(0.02):
            busy.write({"time": time.time(), "event": "step", "round": 0, "step": step,
                        "duration_s": 0.01, "world": 2, "source": "worker"}, True)
            step += 1

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        health = node_health([("", busy_url), ("", idle_url), ("host-c/3", dead_url)],
                             timeout=2.0, interval=0.5)
    finally:
        stop.set()
        thread.join()
        busy.close(0)
        idle.close(0)
    by_name = {h.name: h for h in health}
    assert set(by_name) == {"host-a/1", "host-b/2", "host-c/3"}
    a, b, c = by_name["host-a/1"], by_name["host-b/2"], by_name["host-c/3"]
    assert a.steps_per_s is not None and a.steps_per_s > 0 and a.last_step is not None \
        and a.last_step > 11
    assert b.steps_per_s == 0 and b.last_step == 11 and b.last_committed == 10
    assert a.restarts == 0 and a.world_size == 2
    assert c.error is not None and c.error.startswith("unreachable")
    text = format_health(health)
    assert text.splitlines()[0].startswith("live: ")
    assert "last committed checkpoint at step 10" in text and "(2 of 3 node(s) answered)" in text
    assert "host-c/3: unreachable" in text and "host-b/2: 0.00 steps/s, last step 11" in text


def test_without_any_endpoint_the_live_part_says_how_to_get_one() -> None:
    assert "--metrics-port" in format_health([])
    assert metrics_targets(_Status(round=1, world_size=1,
                                   members=(_Member("a", "h", 1, 0.0),))) == []
    record = {"round": 1, "members": [{"node_id": "a", "host": "10.0.0.5", "metrics_port": 9400}]}
    assert metrics_targets(record) == [("a", "http://10.0.0.5:9400/metrics")]
