"""Acceptance 1 of in-place reconfiguration: a worker SIGKILLed in a 2-node job.

Two ``elastic-run`` agents in the default mode (``auto``: in place, since the worker calls
``elastic.init(inplace=True)``; ``--nproc-per-node 1``) on a real etcd train the float64 MLP of
``inplace_worker.py``. Node 1's worker is SIGKILLed from outside mid-step. Its agent deletes its
member key and starts a replacement on the same node; the other node's worker reconfigures in
place (a world of 1), keeps training, and admits the replacement at a step boundary (a world
of 2), healing it over the process group.

Checks: the surviving worker's pid never changes; the replacement got its state from the
survivor and read no checkpoint; at most one completed step was redone; every step of the
job trained exactly its global batch, once; the final weights equal an undisturbed run's
(same job, no faults) within 1e-5.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip, kill
from tests.integration.training.inplace_audit import check_exactly_once
from tests.integration.training.inplace_job import (
    DATASET,
    EVENT_TIMEOUT,
    GLOBAL_BATCH,
    SEED,
    STEPS,
    InPlaceJob,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

KILL_AFTER = 8
STEP_TIME = 0.05


@dataclass
class Outcome:
    steady: InPlaceJob
    job: InPlaceJob
    survivor_pid: int
    killed_pid: int
    survivor_pid_after: int


def _scenario(tmp: Path, endpoint: str, worker_args: tuple[str, ...] = ()) -> Iterator[Outcome]:
    """The job and its undisturbed twin; ``worker_args`` go to every worker of both
    (``tests/gpu`` runs this with ``("--device", "cuda")``)."""
    with (
        cluster(tmp / "steady", endpoint, f"steady-{uuid.uuid4().hex[:8]}") as steady_cluster,
        cluster(tmp / "job", endpoint, f"inplace-{uuid.uuid4().hex[:8]}") as job_cluster,
    ):
        (tmp / "steady").mkdir(exist_ok=True)
        (tmp / "job").mkdir(exist_ok=True)
        steady = InPlaceJob(steady_cluster, tmp / "steady", ("--nnodes", "2",
                                                              "--max-restarts", "0"),
                            worker_args=worker_args)
        # elastic-run's default mode (auto): in place because the worker declares it.
        job = InPlaceJob(job_cluster, tmp / "job", ("--nnodes", "1:2", "--max-restarts", "3",
                                                      "--inplace-ttl", "5"), mode=None,
                         worker_args=worker_args)
        for _ in range(2):
            steady.start_node()
        job.open_gate(0)
        agents = [job.start_node(STEP_TIME) for _ in range(2)]
        job.wait_for(lambda a: len(job.current_world(a)[1]) == 2, "a world of 2")
        job.open_gate(KILL_AFTER + 6)
        job.wait_for(lambda a: any(d["step"] >= KILL_AFTER for d in a.done),
                     f"step {KILL_AFTER} to complete")
        survivor_pid = job.worker_pid(agents[0])
        killed_pid = job.worker_pid(agents[1])
        kill([killed_pid], signal.SIGKILL)
        gen = job.wait_for(
            lambda a: (g := job.current_world(a))[0] > 0 and len(g[1]) == 2
            and killed_pid not in g[1] and g[0],
            "the replacement worker to be admitted",
        )
        assert gen > 1
        survivor_pid_after = job.worker_pid(agents[0])
        job.open_gate(STEPS)
        for agent in agents:
            assert agent.wait(EVENT_TIMEOUT) == 0, job_cluster.logs()
        for agent in steady_cluster.agents:
            assert agent.wait(EVENT_TIMEOUT) == 0, steady_cluster.logs()
        yield Outcome(steady, job, survivor_pid, killed_pid, survivor_pid_after)


@pytest.fixture(scope="module")
def outcome(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _scenario(tmp_path_factory.mktemp("inplace-worker-kill"), etcd.endpoint)


@pytest.mark.timeout(150)  # includes the module fixture: both jobs and the kill
def test_survivor_keeps_its_process_and_the_weights_match_the_undisturbed_run(
    outcome: Outcome,
) -> None:
    assert outcome.survivor_pid_after == outcome.survivor_pid
    audit = outcome.job.audit()
    survivor_gens = {int(g["gen"]) for g in audit.gens if g["pid"] == outcome.survivor_pid}
    assert survivor_gens == set(audit.pids_by_gen()), "the survivor missed a world"
    steady = torch.load(outcome.steady.weights, weights_only=True)
    weights = torch.load(outcome.job.weights, weights_only=True)
    worst = max((steady[k] - weights[k]).abs().max().item() for k in steady)
    assert worst < 1e-5, f"final weights differ by {worst}"
    assert max(audit.final_attempts()) == max(outcome.steady.audit().final_attempts())


def test_the_replacement_is_healed_by_the_survivor_without_reading_storage(
    outcome: Outcome,
) -> None:
    audit = outcome.job.audit()
    newcomers = [g for g in audit.gens
                 if g["pid"] not in (outcome.survivor_pid, outcome.killed_pid)]
    assert newcomers, "no replacement worker trained"
    first = newcomers[0]
    assert first["received"] and first["storage_loads"] == 0, first
    assert first["source"] >= 0


def test_at_most_one_step_is_redone_and_every_sample_is_trained_once(outcome: Outcome) -> None:
    audit = outcome.job.audit()
    assert len(audit.redone_steps()) <= 1, audit.redone_steps()
    check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                       seed=SEED)
    check_exactly_once(outcome.steady.audit(), steps=STEPS, global_batch=GLOBAL_BATCH,
                       dataset=DATASET, seed=SEED)
