"""Acceptance 1 of live metrics: a real standalone job, scraped over HTTP while it trains.

``elastic-run --standalone --nproc-per-node 2 --metrics-port P examples/train.py``: both workers
report their steps to the agent over its telemetry socket; ``/metrics`` is scraped twice, 5 s
apart, and parsed with ``prometheus_client.parser``; the step counter rises and the world size
reads 2. ``elastic-run status --metrics`` reads the same endpoint. The job's event log still gets
every step exactly once (global rank 0's copy), and the goodput report reads it.
"""

from __future__ import annotations

import re
import socket
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic.eventlog import read_events
from tests.integration.launcher_scripts.harness import REPO, cluster, wait_until
from tests.integration.launcher_scripts.status_cli import run_status

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "train.py"
STEPS = 260


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("node"), sample  # every series names its node
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def _scrape_or_none(url: str) -> dict[str, float] | None:
    try:
        return _scrape(url)
    except OSError:
        return None


@pytest.mark.timeout(240)
def test_a_standalone_job_is_scraped_twice_and_its_steps_rise(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    job = f"metrics-{uuid.uuid4().hex[:8]}"
    events = tmp_path / "events"
    with cluster(tmp_path, "", job) as c:
        agent = c.start(
            ["--standalone", "--job-id", job, "--nproc-per-node", "2", "--metrics-port",
             str(port), "--metrics-host", "127.0.0.1", "--events-dir", str(events)],
            [str(EXAMPLE), "--steps", str(STEPS), "--step-time", "0.04", "--checkpoint-dir",
             str(tmp_path / "ckpt"), "--checkpoint-every", "40"],
        )
        seen: list[dict[str, float]] = []

        def training() -> bool:
            got = _scrape_or_none(url)
            if got and got.get("elastic_run_steps_total", 0) > 0:
                seen.append(got)
                return True
            return False

        try:
            wait_until(training, 150, "the first scraped step", give_up=c.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None
        first = _scrape(url)
        later: list[dict[str, float]] = []

        def trained_on_and_committed() -> bool:
            # Until the counters moved on and the checkpoint at step 40 was committed.
            got = _scrape_or_none(url)
            if not got or got.get("elastic_run_steps_total", 0) <= \
                    first["elastic_run_steps_total"] or \
                    got.get("elastic_run_checkpoint_durable_seconds_count", 0) < 1:
                return False
            later.append(got)
            return True

        try:
            wait_until(trained_on_and_committed, 120, "more steps and a committed checkpoint",
                       give_up=c.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None
        second = later[-1]
        assert second["elastic_run_steps_total"] > first["elastic_run_steps_total"]
        assert first["elastic_run_world_size"] == second["elastic_run_world_size"] == 2
        assert second["elastic_run_step_seconds_count"] == second["elastic_run_steps_total"]
        assert second["elastic_run_checkpoint_last_committed_step"] >= 40
        assert second["elastic_run_checkpoint_durable_seconds_count"] >= 1
        assert second["elastic_run_events_dropped_total"] == 0

        endpoint = re.search(r"Standalone etcd at (127\.0\.0\.1:\d+)", agent.output())
        assert endpoint, agent.output()
        status = run_status(endpoint.group(1), job, "--metrics", f"127.0.0.1:{port}")
        assert status.returncode == 0, status.stderr
        live = status.stdout[status.stdout.index("live: "):]
        assert re.match(r"live: \d+\.\d\d steps/s, last committed checkpoint at step \d+, "
                        r"world size 2 \(1 of 1 node\(s\) answered\)", live), live
        assert re.search(r"last step \d+ \(\d+\.\d s ago\), restarts 0", live), live

        assert agent.wait(180) == 0, c.logs()
    steps = sorted(e["step"] for e in read_events(events) if e["event"] == "step")
    assert steps == list(range(STEPS)), "the job log must get each step once"
