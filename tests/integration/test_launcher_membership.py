"""Acceptance 2 and the agent's own-death handling: real agents, real etcd, real kills."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import (
    alive,
    cluster,
    etcd_or_skip,
    kill,
    wait_until,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Any:
    return etcd_or_skip(request)


def _job() -> str:
    return f"launcher-{uuid.uuid4().hex[:10]}"


def test_lost_and_joining_nodes_do_not_consume_restarts(
    tmp_path: Path, etcd: Any
) -> None:
    stop = tmp_path / "stop"
    with cluster(tmp_path, etcd.endpoint, _job()) as c:
        wargs = c.worker_args("--stop-file", str(stop), steps=100_000)
        flags = ("--min-nodes", "2", "--max-nodes", "3", "--max-restarts", "0")
        a, b, victim = (c.start_elastic(*flags, worker_args=wargs) for _ in range(3))
        try:
            c.wait_for(lambda st: any(s.world == 3 for s in st), 90, "a world of 3")
            victim_workers = victim.worker_pids()
            round3 = c.steps()[-1].round
            victim.kill_tree()  # the whole node: agent and workers
            assert not any(alive(p) for p in victim_workers)
            n = len(c.steps())
            c.wait_for(lambda st: any(s.world == 2 for s in st[n:]), 90,
                       "the two survivors to train on in a new round")
            round2 = next(s.round for s in c.steps()[n:] if s.world == 2)
            assert round2 != round3

            late = c.start_elastic(*flags, worker_args=wargs)
            n = len(c.steps())
            c.wait_for(lambda st: any(s.world == 3 for s in st[n:]), 90,
                       "the late node to be admitted")
            late_pids = set(late.worker_pids())
            c.wait_for(lambda st: any(s.pid in late_pids for s in st[n:]), 60,
                       "the late node's worker to train")
            stop.touch()
            codes = [agent.wait(60) for agent in (a, b, late)]
        except BaseException:
            print(c.logs())
            raise
        assert codes == [0, 0, 0], c.logs()
        steps = [s.step for s in c.steps() if s.rank == 0]
        # Each round resumes from the last checkpointed step: no step goes backwards by more
        # than the one in flight when the node was lost.
        assert all(later >= earlier - 1 for earlier, later in itertools.pairwise(steps))


def test_a_node_past_its_crash_budget_leaves_and_too_few_nodes_end_the_job(
    tmp_path: Path, etcd: Any
) -> None:
    with cluster(tmp_path, etcd.endpoint, _job()) as c:
        # Rank 0 of the first round crashes at step 5; the budget is 0 crashes.
        wargs = c.worker_args("--crash-at-step", "5", steps=100_000)
        flags = ("--nnodes", "2", "--max-restarts", "0", "--rdzv-conf", "join_timeout=10")
        agents = [c.start_elastic(*flags, worker_args=wargs) for _ in range(2)]
        codes = [agent.wait(90) for agent in agents]
        crashed = [a for a in agents if "crashed 1 times" in a.output()]
        assert len(crashed) == 1, c.logs()
        other = next(a for a in agents if a is not crashed[0])
        # The crashing node leaves, saying why; the job goes on without it while it can...
        assert crashed[0].output().rstrip().splitlines()[-1] == (
            "elastic-run: error: this node's workers crashed 1 times within 3600 s "
            "(--max-restarts 0); it left the job, which goes on with the other nodes.")
        assert codes[agents.index(crashed[0])] == 1
        # ...but with --min-nodes 2 it cannot: the other node ends, naming the reason.
        assert codes[agents.index(other)] == 3, c.logs()
        last = other.output().rstrip().splitlines()[-1]
        assert last.startswith("elastic-run: error: this node found no world to train in for ")
        assert "(fewer than --min-nodes (2) nodes could train)" in last


def test_killing_an_agent_kills_its_workers_and_the_others_go_on(
    tmp_path: Path, etcd: Any
) -> None:
    stop = tmp_path / "stop"
    with cluster(tmp_path, etcd.endpoint, _job()) as c:
        wargs = c.worker_args("--stop-file", str(stop), steps=100_000)
        flags = ("--nnodes", "1:2", "--max-restarts", "3")
        survivor, victim = (c.start_elastic(*flags, worker_args=wargs) for _ in range(2))
        c.wait_for(lambda st: any(s.world == 2 for s in st), 90, "a world of 2")
        orphans = victim.worker_pids()
        assert orphans
        kill([victim.pid])  # the agent only: its workers live in sessions of their own
        wait_until(lambda: not any(alive(p) for p in orphans), 15,
                   "the dead agent's workers to exit")
        n = len(c.steps())
        c.wait_for(lambda st: any(s.world == 1 for s in st[n:]), 90,
                   "the survivor to train alone in a new round")
        stop.touch()
        assert survivor.wait(60) == 0, c.logs()


def test_a_dead_node_does_not_hold_a_finished_one(tmp_path: Path, etcd: Any) -> None:
    with cluster(tmp_path, etcd.endpoint, _job()) as c:
        # Rank 1 lingers after training, so its node is not done when rank 0's finishes.
        wargs = c.worker_args("--linger-rank", "1", "--linger-s", "300", steps=15)
        flags = ("--nnodes", "2", "--max-restarts", "0")
        c.start_elastic(*flags, worker_args=wargs)
        c.start_elastic(*flags, worker_args=wargs)
        c.wait_for(lambda st: any(s.step == 15 and s.rank == 1 for s in st), 90,
                   "the last step")
        rank1_pid = next(s.pid for s in c.steps() if s.rank == 1 and s.step == 15)
        lingering = c.agent_of_pid(rank1_pid)
        finished = next(a for a in c.agents if a is not lingering)
        wait_until(lambda: "waiting for the rest of the job" in finished.output(), 60,
                   "the finished node to wait for the others")
        assert finished.proc.poll() is None  # a live node that is not done is waited for
        lingering.kill_tree()
        assert finished.wait(60) == 0, c.logs()
        assert "finished" in finished.output().rstrip().splitlines()[-1], c.logs()


def test_repeated_worker_kills_never_hang_the_restart(tmp_path: Path, etcd: Any) -> None:
    with cluster(tmp_path, etcd.endpoint, _job()) as c:
        wargs = c.worker_args(steps=60, step_time=0.05)
        flags = ("--nnodes", "2", "--max-restarts", "5")
        agents = [c.start_elastic(*flags, worker_args=wargs) for _ in range(2)]
        killed: set[int] = set()
        for _ in range(3):
            n = len(c.steps())
            c.wait_for(
                lambda st, n=n: len([s for s in st[n:] if s.pid not in killed]) >= 6, 90,
                "training to resume after a worker SIGKILL",
            )
            victims = agents[1].worker_pids()
            killed.update(victims)
            kill(victims)
        codes = [agent.wait(120) for agent in agents]
        assert codes == [0, 0], c.logs()
        finals = {s.rank: s for s in c.steps() if s.step == 60}
        assert set(finals) == {0, 1}
        assert not {s.pid for s in finals.values()} & killed
