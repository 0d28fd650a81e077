"""Acceptance 3 of in-place reconfiguration: many faults in one run, some during recovery.

Three ``elastic-run --elastic-mode inplace`` agents (``--nproc-per-node 1``) on a real etcd
train the float64 MLP of ``inplace_worker.py`` while the test injects 15 faults in 13
rounds; each round waits until the job made progress again (a step completed since the last):

==  =====================================================================================
 1  worker SIGKILL on node A
 2  worker SIGKILL on node B, then at once (3) on node C once a survivor noticed the first
    one (its step was abandoned): C dies while the world is being rebuilt
 4  node B lost (its agent and worker SIGKILLed together; its member key expires)
 5  node D joins
 6  worker SIGKILL on D, then (7) its replacement SIGKILLed as soon as it is placed in a
    world: the others are building that world's groups or healing it
 8  node C lost, then (9) A's worker SIGKILLed once a survivor noticed the loss, before
    the next step
10  node E joins, and (11) E's worker is SIGKILLed as soon as it is placed in a world
12  node A lost while D's worker is SIGKILLed in the same instant
13  every worker (D's and E's) SIGKILLed at once: nobody holds the state, so the new world
    restores the last committed checkpoint (the storage fallback)
==  =====================================================================================

The remaining agents (D and E) finish the job. Checks: both exit 0; the final weights equal
an undisturbed run's within 1e-5 after the same number of steps; every step trained exactly
its global batch, once (the per-sample audit); redone work is at most one step per fault
with a survivor plus the loop's lost-work bound for the last one; every newcomer before the
last fault was healed by a survivor and read no checkpoint. Everything is bounded by timeouts
(a hang fails the test with the agents' logs). About 70 s on 2 loaded cores.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import (
    Agent,
    Cluster,
    cluster,
    etcd_or_skip,
    kill,
    wait_until,
    workers,
)
from tests.integration.training.inplace_audit import check_exactly_once
from tests.integration.training.inplace_job import (
    DATASET,
    GLOBAL_BATCH,
    INTERVAL,
    SEED,
    InPlaceJob,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

STEPS = 60
STEP_TIME = 0.05
TTL = 3
BUILD_TIMEOUT = 4.0
WAIT = 60.0
_ABANDONED = re.compile(r"step \d+ abandoned \(")
MAX_COMMIT_LAG = INTERVAL  # ElasticLoop's default


@dataclass
class Faults:
    """The job under test and what was done to it."""

    job: InPlaceJob
    cluster: Cluster
    log: list[str] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)

    # -- observation ------------------------------------------------------------------------

    def progress(self) -> int:
        """The highest step any worker completed (-1 before the first)."""
        return max((int(d["step"]) for d in self.job.audit().done), default=-1)

    def wait(self, pred: Callable[[], Any], what: str, timeout: float = WAIT) -> None:
        try:
            wait_until(lambda: bool(pred()), timeout, what, give_up=self.cluster.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nfaults so far: {self.log}\n{self.cluster.logs()}"
                                 ) from None

    def worker(self, agent: Agent) -> int:
        """The agent's running worker (waits while the agent starts a replacement)."""
        found: list[int] = []

        def one() -> bool:
            pids = [p for p in workers(agent) if p not in self.dead]
            found[:] = pids
            return len(pids) == 1

        self.wait(one, f"agent {agent.pid} to run a worker")
        return found[0]

    def abandoned(self) -> int:
        return sum(len(_ABANDONED.findall(a.output())) for a in self.cluster.agents)

    def placed(self, pid: int) -> bool:
        """Whether worker ``pid`` has adopted or proposed a world that includes it."""
        text = "".join(a.output() for a in self.cluster.agents)
        return re.search(rf"\[{pid}\]: world epoch \d+ built|quorum\[{pid}\]: in-place "
                         rf"world epoch", text) is not None

    def world_pids(self) -> set[int]:
        return self.job.current_world(self.job.audit())[1]

    # -- faults -----------------------------------------------------------------------------

    def advance(self, steps: int = 2) -> None:
        """Lets the job run ``steps`` more steps and waits for them (it recovered)."""
        target = self.progress() + steps
        self.job.open_gate(target + 3)
        self.wait(lambda: self.progress() >= target, f"step {target} after {self.log[-1:]}")

    def kill_worker(self, agent: Agent, pid: int | None = None) -> int:
        pid = self.worker(agent) if pid is None else pid
        kill([pid], signal.SIGKILL)
        self.dead.add(pid)
        self.log.append(f"worker {pid} of agent {agent.pid} killed")
        return pid

    def kill_node(self, agent: Agent) -> None:
        self.dead.update(workers(agent))
        agent.kill_tree()
        self.log.append(f"node {agent.pid} lost")

    def join(self) -> Agent:
        agent = self.job.start_node(STEP_TIME)
        self.log.append(f"node {agent.pid} joined")
        return agent

    def after_detection(self, before: int) -> None:
        """Waits until a survivor abandoned a step since ``before`` (the fault was seen)."""
        self.wait(lambda: self.abandoned() > before, "a survivor to notice the fault", 30.0)

    def kill_when_placed(self, agent: Agent) -> int:
        """SIGKILLs the agent's next worker as soon as it is placed in a world."""
        found: list[int] = []

        def placed() -> bool:
            pids = [p for p in workers(agent) if p not in self.dead]
            if len(pids) == 1 and self.placed(pids[0]):
                found.append(pids[0])
                return True
            return False

        self.wait(placed, f"a worker of agent {agent.pid} to be placed in a world")
        return self.kill_worker(agent, found[0])


@dataclass
class Outcome:
    steady: InPlaceJob
    job: InPlaceJob
    faults: list[str]
    exit_codes: list[int]
    seconds: float


def _scenario(tmp: Path, endpoint: str) -> Iterator[Outcome]:
    with (
        cluster(tmp / "steady", endpoint, f"steady-{uuid.uuid4().hex[:8]}") as steady_cluster,
        cluster(tmp / "job", endpoint, f"faults-{uuid.uuid4().hex[:8]}") as job_cluster,
    ):
        (tmp / "steady").mkdir(exist_ok=True)
        (tmp / "job").mkdir(exist_ok=True)
        steady = InPlaceJob(steady_cluster, tmp / "steady", ("--nnodes", "2",
                                                              "--max-restarts", "0"), STEPS)
        job = InPlaceJob(job_cluster, tmp / "job", (
            "--nnodes", "1:3", "--max-restarts", "6", "--inplace-ttl", str(TTL),
            "--inplace-build-timeout", str(BUILD_TIMEOUT)), STEPS)
        for _ in range(2):
            steady.start_node()
        started = time.monotonic()
        f = Faults(job, job_cluster)
        job.open_gate(0)
        a, b, c = (job.start_node(STEP_TIME) for _ in range(3))
        f.wait(lambda: len(f.world_pids()) == 3, "a world of 3")
        f.log.append("world of 3")
        f.advance()


        def full() -> bool:  # a world of 3 live workers trains
            pids = f.world_pids()
            return len(pids) == 3 and not pids & f.dead

        f.kill_worker(a)  # 1
        f.wait(full, "A's replacement to train")
        before = f.abandoned()
        f.kill_worker(b)  # 2
        f.after_detection(before)
        f.kill_worker(c)  # 3: during the recovery from 2 (A's worker holds the state)
        f.advance()
        f.wait(full, "the replacements of B and C to train")
        f.kill_node(b)  # 4
        f.advance()
        d = f.join()  # 5
        f.wait(lambda: full() and f.worker(d) in f.world_pids(), "node D's worker to train")
        f.kill_worker(d)  # 6
        f.kill_when_placed(d)  # 7: while the world with D's replacement is built or healed
        f.advance()
        f.wait(lambda: full() and f.worker(d) in f.world_pids(),
               "node D's third worker to train")
        before = f.abandoned()
        f.kill_node(c)  # 8
        f.after_detection(before)
        f.kill_worker(a)  # 9: during the recovery from the node loss (D holds the state)
        f.advance()
        e = f.join()  # 10
        f.kill_when_placed(e)  # 11
        f.wait(lambda: full() and f.worker(e) in f.world_pids(),
               "node E's replacement worker to train")
        f.advance()
        d_worker = f.worker(d)
        f.kill_node(a)  # 12
        f.kill_worker(d, d_worker)  # 12: in the same instant (E holds the state)
        f.advance()
        f.wait(lambda: len(f.world_pids()) == 2 and not f.world_pids() & f.dead,
               "D's replacement to train")
        f.advance(INTERVAL + MAX_COMMIT_LAG + 1)  # a checkpoint committed since the last fault
        f.kill_worker(d)  # 13: every worker at once: the job restores from storage
        f.kill_worker(e)
        f.advance()

        job.open_gate(STEPS)
        codes = [agent.wait(WAIT) for agent in (d, e)]
        for agent in steady_cluster.agents:
            assert agent.wait(WAIT) == 0, steady_cluster.logs()
        yield Outcome(steady, job, f.log, codes, time.monotonic() - started)


@pytest.fixture(scope="module")
def outcome(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _scenario(tmp_path_factory.mktemp("inplace-repeated-faults"), etcd.endpoint)


@pytest.mark.timeout(300)  # includes the module fixture: both jobs and every fault
def test_fifteen_faults_and_the_job_finishes_with_the_undisturbed_weights(
    outcome: Outcome,
) -> None:
    kills = [x for x in outcome.faults if "killed" in x or "lost" in x or "joined" in x]
    assert len(kills) == 15, outcome.faults
    assert outcome.exit_codes == [0, 0], outcome.job.cluster.logs()
    steady = torch.load(outcome.steady.weights, weights_only=True)
    weights = torch.load(outcome.job.weights, weights_only=True)
    worst = max((steady[k] - weights[k]).abs().max().item() for k in steady)
    assert worst < 1e-5, f"final weights differ by {worst}"
    assert max(outcome.job.audit().final_attempts()) == STEPS - 1
    assert max(outcome.steady.audit().final_attempts()) == STEPS - 1


def test_every_sample_is_trained_once_and_each_fault_redoes_at_most_one_step(
    outcome: Outcome,
) -> None:
    audit = outcome.job.audit()
    check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                       seed=SEED)
    # 12 faults with a survivor cost at most one step each; the last one (every worker
    # killed) at most what the loop's lost-work bound allows (interval + commit lag).
    bound = 12 + INTERVAL + MAX_COMMIT_LAG
    assert len(audit.redone_steps()) <= bound, audit.redone_steps()


def test_state_came_from_survivors_and_from_storage_only_when_every_worker_died(
    outcome: Outcome,
) -> None:
    audit = outcome.job.audit()
    first_gen = min(audit.pids_by_gen())
    firsts: dict[int, dict[str, Any]] = {}
    for g in audit.gens:  # each process's first world (its counters then say how it began)
        firsts.setdefault(int(g["pid"]), g)
    newcomers = [g for g in firsts.values() if g["gen"] > first_gen]
    from_storage = [g for g in newcomers if g["storage_loads"]]
    assert from_storage, "nobody read storage after every worker died"
    whole_loss = min(int(g["gen"]) for g in from_storage)
    assert all(g["gen"] == whole_loss for g in from_storage), from_storage
    healed = [g for g in newcomers if g["gen"] < whole_loss]
    assert len(healed) >= 6, healed
    assert all(g["received"] and g["source"] >= 0 for g in healed), healed
