"""Acceptance 2 of live metrics: a 3-node in-place job, one worker SIGKILLed.

Three ``elastic-run`` agents (in place, ``--nproc-per-node 1``, ``--metrics-port``) train
``inplace_worker.py`` on a real etcd. Every node's ``/metrics`` is scraped once the world of 3
trains (before) and again once the job trains in the world that admitted the replacement
(after); between the two, node 1's worker is SIGKILLed. The series must move by exactly that
change, as each node lived through it (the workers' audit says which worlds each node trained
in):

* node 1 (its worker crashed, its agent restarted it): one change, ``worker_failed``, and one
  worker restart;
* nodes 0 and 2 (survivors, never restarted): the same ``worker_failed`` (the job's cause of
  the change, whichever came first on that node: its workers' failed collective or the new
  world), then ``node_joined`` when they admitted the replacement;
* each change adds one observation to every recovery part, and the parts add up to the total.
"""

from __future__ import annotations

import signal
import socket
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip, kill, wait_until
from tests.integration.training.inplace_audit import Audit
from tests.integration.training.inplace_job import EVENT_TIMEOUT, STEPS, InPlaceJob

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

KILL_AFTER = 8
STEP_TIME = 0.05
PARTS = ("detection", "rendezvous", "restore", "total")
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("job_id", "node")))
            out[(s.name, labels)] = s.value
    return out


def _kinds(series: Series) -> dict[str, float]:
    return {dict(labels)["kind"]: v for (name, labels), v in series.items()
            if name == "elastic_run_membership_changes_total"}


def _delta(after: Series, before: Series, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _trained_gens(audit: Audit, pids: set[int]) -> set[int]:
    ranks_by_gen = {(int(g["gen"]), int(g["rank"])) for g in audit.gens if int(g["pid"]) in pids}
    return {gen for gen, rank in ranks_by_gen
            if any(int(d["gen"]) == gen and int(d["rank"]) == rank for d in audit.done)}


@pytest.mark.timeout(200)
def test_the_change_counters_move_by_exactly_the_worker_kill(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    ports = [_free_port() for _ in range(3)]
    with cluster(tmp_path, etcd.endpoint, f"metrics-{uuid.uuid4().hex[:8]}") as c:
        job = InPlaceJob(c, tmp_path, ("--nnodes", "1:3", "--max-restarts", "3",
                                       "--inplace-ttl", "5"), mode=None)
        job.open_gate(0)
        agents = [job.start_node(STEP_TIME, "--metrics-port", str(p), "--metrics-host",
                                 "127.0.0.1") for p in ports]
        job.wait_for(lambda a: len(job.current_world(a)[1]) == 3, "a world of 3")
        job.open_gate(KILL_AFTER + 4)
        job.wait_for(lambda a: any(d["step"] >= KILL_AFTER for d in a.done),
                     f"step {KILL_AFTER} to complete in the world of 3")
        pids = [job.worker_pid(a) for a in agents]

        def steady(ports_: list[int], step: int) -> bool:
            return all(_scrape(p).get(("elastic_run_last_step", ()), -1) >= step
                       for p in ports_)

        wait_until(lambda: steady(ports, KILL_AFTER), EVENT_TIMEOUT, "every node's step")
        before = [_scrape(p) for p in ports]
        audit_before = job.audit()
        trained_before = [_trained_gens(audit_before, {pid}) for pid in pids]

        kill([pids[1]], signal.SIGKILL)
        job.open_gate(KILL_AFTER + 8)  # the survivors train on in a world of 2
        job.wait_for(
            lambda a: (g := job.current_world(a))[0] > 0 and len(g[1]) == 3
            and pids[1] not in g[1] and g[0],
            "the replacement worker to be admitted",
        )
        replacement = job.worker_pid(agents[1])
        job.open_gate(STEPS - 4)
        try:
            wait_until(lambda: steady(ports, STEPS - 5), EVENT_TIMEOUT,
                       "every node to train in the world that admitted the replacement")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None
        after = [_scrape(p) for p in ports]
        audit = job.audit()
        job.open_gate(STEPS)
        for agent in agents:
            assert agent.wait(EVENT_TIMEOUT) == 0, c.logs()

    node_pids = [{pids[0]}, {pids[1], replacement}, {pids[2]}]
    for n in range(3):
        worlds = len(_trained_gens(audit, node_pids[n])) - len(trained_before[n])
        changes = {kind: after[n].get(("elastic_run_membership_changes_total",
                                       (("kind", kind),)), 0.0) - v
                   for kind, v in _kinds(before[n]).items()}
        moved = {kind: d for kind, d in changes.items() if d}
        assert sum(moved.values()) == worlds, (n, moved, worlds)
        if n == 1:
            assert moved == {"worker_failed": 1}, moved
            assert _delta(after[n], before[n], "elastic_run_worker_restarts_total") == 1
        else:
            assert moved == {"worker_failed": 1, "node_joined": worlds - 1}, (n, moved)
            assert _delta(after[n], before[n], "elastic_run_worker_restarts_total") == 0
        for part in PARTS:
            assert _delta(after[n], before[n], "elastic_run_recovery_seconds_count",
                          part=part) == worlds, (n, part)
        sums = {part: _delta(after[n], before[n], "elastic_run_recovery_seconds_sum", part=part)
                for part in PARTS}
        assert sums["total"] > 0
        assert sums["total"] == pytest.approx(
            sums["detection"] + sums["rendezvous"] + sums["restore"], abs=1e-6)
        assert _delta(after[n], before[n], "elastic_run_steps_redone_total") <= 1
        assert after[n][("elastic_run_world_size", ())] == 3
