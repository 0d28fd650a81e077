"""Acceptance 2 of in-place reconfiguration: a node lost and a node joining.

Two ``elastic-run --elastic-mode inplace`` agents train; node 1 is lost (its agent and worker
SIGKILLed together, so nobody on that node deletes the worker's member key: the survivor finds
its liveness port closed and deletes it). The survivor goes on alone in place; then a new node
starts, builds its model slowly (``--setup-delay``), and its worker is admitted at a step
boundary once it enters its loop, and healed by the survivor.

Checks: the survivor's pid never changes and it is in every world; it kept training while the
joiner built its model; the joiner's state came from the survivor and it read no checkpoint
(its loop's storage-load counter is 0); at most one completed step was redone; exactly-once
per step; final weights equal an undisturbed run's within 1e-5.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip
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
SETUP_DELAY = 5.0  # ample for a step of the survivor even on 2 loaded cores


@dataclass
class Outcome:
    steady: InPlaceJob
    job: InPlaceJob
    survivor_pid: int
    lost_pid: int
    joiner_pids: set[int]


def _scenario(tmp: Path, endpoint: str) -> Iterator[Outcome]:
    with (
        cluster(tmp / "steady", endpoint, f"steady-{uuid.uuid4().hex[:8]}") as steady_cluster,
        cluster(tmp / "job", endpoint, f"inplace-{uuid.uuid4().hex[:8]}") as job_cluster,
    ):
        (tmp / "steady").mkdir(exist_ok=True)
        (tmp / "job").mkdir(exist_ok=True)
        steady = InPlaceJob(steady_cluster, tmp / "steady", ("--nnodes", "2",
                                                              "--max-restarts", "0"))
        job = InPlaceJob(job_cluster, tmp / "job", ("--nnodes", "1:3", "--max-restarts", "0",
                                                    "--inplace-ttl", "3"))
        for _ in range(2):
            steady.start_node()
        job.open_gate(0)
        agents = [job.start_node(STEP_TIME) for _ in range(2)]
        job.wait_for(lambda a: len(job.current_world(a)[1]) == 2, "a world of 2")
        job.open_gate(KILL_AFTER + 4)
        job.wait_for(lambda a: any(d["step"] >= KILL_AFTER for d in a.done),
                     f"step {KILL_AFTER} to complete")
        survivor_pid = job.worker_pid(agents[0])
        lost_pid = job.worker_pid(agents[1])
        agents[1].kill_tree()  # node loss: agent and worker at once
        job.wait_for(lambda a: job.current_world(a)[1] == {survivor_pid},
                     "the survivor to train alone")
        before = set(job.audit().pids_by_gen()[job.current_world(job.audit())[0]])
        job.start_node(STEP_TIME, setup_delay=SETUP_DELAY)  # a new node joins
        # Release a few steps once the joiner is building its model: the survivor must be
        # able to train them meanwhile (a joiner is admitted from its loop, not from init).
        job.wait_for(lambda a: any(s["phase"] == "began" for s in a.setups),
                     "the joiner to start building its model")
        job.open_gate(KILL_AFTER + 8)
        gen_pids = job.wait_for(
            lambda a: (w := job.current_world(a))[1] - before - {lost_pid} and w[1],
            "the new node's worker to be admitted",
        )
        joiner_pids = set(gen_pids) - {survivor_pid}
        job.open_gate(STEPS)
        for agent in job_cluster.agents:
            if agent is not agents[1]:
                assert agent.wait(EVENT_TIMEOUT) == 0, job_cluster.logs()
        for agent in steady_cluster.agents:
            assert agent.wait(EVENT_TIMEOUT) == 0, steady_cluster.logs()
        yield Outcome(steady, job, survivor_pid, lost_pid, joiner_pids)


@pytest.fixture(scope="module")
def outcome(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _scenario(tmp_path_factory.mktemp("inplace-node-loss"), etcd.endpoint)


@pytest.mark.timeout(150)
def test_survivor_stays_and_the_weights_match_the_undisturbed_run(outcome: Outcome) -> None:
    audit = outcome.job.audit()
    survivor_gens = {int(g["gen"]) for g in audit.gens if g["pid"] == outcome.survivor_pid}
    assert survivor_gens == set(audit.pids_by_gen()), "the survivor missed a world"
    steady = torch.load(outcome.steady.weights, weights_only=True)
    weights = torch.load(outcome.job.weights, weights_only=True)
    worst = max((steady[k] - weights[k]).abs().max().item() for k in steady)
    assert worst < 1e-5, f"final weights differ by {worst}"


def test_the_survivor_kept_training_while_the_joiner_built_its_model(outcome: Outcome) -> None:
    audit = outcome.job.audit()
    (began,) = [s["t"] for s in audit.setups if s["phase"] == "began"]
    (ended,) = [s["t"] for s in audit.setups if s["phase"] == "ended"]
    # Only the survivor trains then (the lost node is dead, the joiner is not in its loop).
    during = [d["step"] for d in audit.done if began < d["t"] < ended]
    assert during, (f"no step completed while the joiner built its model "
                    f"({ended - began:.1f} s): the survivor waited for it")


def test_the_joiner_is_healed_by_the_survivor_without_reading_storage(outcome: Outcome) -> None:
    audit = outcome.job.audit()
    assert outcome.joiner_pids
    for pid in outcome.joiner_pids:
        first = next(g for g in audit.gens if g["pid"] == pid)
        assert first["received"] and first["storage_loads"] == 0, first


def test_at_most_one_step_is_redone_and_every_sample_is_trained_once(outcome: Outcome) -> None:
    audit = outcome.job.audit()
    assert len(audit.redone_steps()) <= 1, audit.redone_steps()
    check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                       seed=SEED)
