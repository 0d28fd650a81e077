"""Default flags survive crashes: five worker SIGKILLs spread over a 3-node job.

``examples/train.py`` as shipped on three ``elastic-run`` agents with no flag beyond the node
counts, etcd and job id (so the default crash budget of 3 per node, with its backoff): five
workers are SIGKILLed, two on node 0, two on node 1, one on node 2, one every 30 steps
whether the previous one has been recovered or not (a kill often lands while a replacement
is still on its way). Once in place (the default for a script that uses ``ElasticLoop``:
only the killed worker is replaced, healed by a survivor; storage is read only in a world
where every worker that held the state was killed, which kills 30 steps apart can do on a
loaded host while two replacements are still starting) and once with
``--elastic-mode restart`` (every worker restarts from the last checkpoint).

Every agent exits 0, the job trains to its last step, every step's global batch was trained
exactly once, and the final float64 weights equal an undisturbed 1-node run's (< 1e-9).
The kills follow the job's steps, not the clock, so a slow host only makes the test slower.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import Agent, cluster, etcd_or_skip, wait_until
from tests.integration.training.example_job import (
    WAIT_S,
    ExampleJob,
    max_difference,
    reference_weights,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 200
STEP_S = 0.15
KILLS = ((15, 0), (45, 1), (75, 2), (105, 0), (135, 1))  # (at step, node)


def _worker_of(job: ExampleJob, agent: Agent) -> int:
    """The node's worker (waits while it is between two incarnations)."""
    found: list[int] = []

    def one() -> bool:
        found[:] = agent.worker_pids()
        return len(found) == 1

    wait_until(one, WAIT_S, f"a worker of agent {agent.pid}", give_up=job.cluster.all_exited)
    return found[0]


def _storage_restores(gens: list[dict[str, Any]]) -> list[tuple[int, set[int]]]:
    """The worlds that read the last checkpoint from storage after the job's first, each as
    (generation, its workers' pids): a world in which some worker's count of storage reads
    went up (each worker of such a world reads it). The first is the first world that
    trained, not always generation 1: a node that joins while the first world of two is
    built restarts it (restart mode, before the in-place upgrade), and its workers never
    reach their loop."""
    loads: dict[int, int] = {}
    out: dict[int, set[int]] = {}
    first = min((int(g["gen"]) for g in gens), default=0)
    for g in sorted(gens, key=lambda g: int(g["gen"])):
        pid, count = int(g["pid"]), int(g["storage_loads"])
        if count > loads.get(pid, 0) and int(g["gen"]) > first:
            out.setdefault(int(g["gen"]), set()).add(pid)
        loads[pid] = count
    return sorted(out.items())


@pytest.mark.parametrize("mode", [None, "restart"], ids=["in-place", "restart"])
def test_five_worker_kills_over_three_nodes_end_nothing_with_default_flags(
    request: pytest.FixtureRequest, tmp_path: Path, mode: str | None
) -> None:
    etcd: Any = etcd_or_skip(request)
    flags = ("--elastic-mode", mode) if mode else ()
    with cluster(tmp_path, etcd.endpoint, f"kills-{uuid.uuid4().hex[:8]}") as c:
        job = ExampleJob(c, tmp_path / "job", steps=STEPS, min_nodes=2, max_nodes=3)
        agents = [job.start_node(*flags, step_time=STEP_S) for _ in range(3)]
        job.trained_in(lambda w, _p: w == 3, "a step in a world of 3")
        if mode is None:
            job.wait_in_place(3)  # from the first step on (every worker is in its loop)
        started = {p for a in agents for p in a.worker_pids()}
        killed = set()
        for at, node in KILLS:
            job.wait_for(lambda _a, at=at: job.steps_done() > at, f"step {at}")
            victim = _worker_of(job, agents[node])
            os.kill(victim, signal.SIGKILL)
            killed.add(victim)
        codes = job.wait_all(agents)
        assert codes == [0, 0, 0], c.logs()

        audit = job.check_audit()
        if mode is None:
            # In place: only the killed workers were replaced; the others kept their
            # processes and their place in every world to the last.
            last = audit.pids_by_gen()[max(audit.pids_by_gen())]
            assert started - killed <= last, (sorted(started), sorted(killed), sorted(last))
            # The first workers read storage once, at the job's fresh start.
            for g in audit.gens:
                assert int(g["pid"]) not in started or int(g["storage_loads"]) == 1, g
            by_gen = audit.pids_by_gen()
            restores = _storage_restores(audit.gens)
            print(f"[kills] worlds restored from storage after the fresh start: {restores}")
            for gen, pids in restores:
                # Storage is read only when every worker that held the state was killed
                # (a kill every 30 steps can outrun a replacement's cold start on a loaded
                # host): none of the world's workers trained before, and every worker of
                # the world before it was killed.
                before = {p for g, ps in by_gen.items() if g < gen for p in ps}
                assert not pids & before, (gen, sorted(pids), by_gen)
                previous = by_gen[max(g for g in by_gen if g < gen)]
                assert previous <= killed, (gen, sorted(previous), sorted(killed))
            # Otherwise each replacement was healed by a survivor.
            restored = {p for _, pids in restores for p in pids}
            first = {int(g["pid"]): g for g in sorted(audit.gens, key=lambda g: -int(g["gen"]))}
            assert all(g["received"] for p, g in first.items()
                       if p not in started | restored), first

    worst = max_difference(job.weights(), reference_weights(etcd.endpoint, tmp_path, STEPS))
    assert worst < 1e-9, f"final weights differ from an undisturbed 1-node run's by {worst}"


def test_a_worker_kill_at_two_workers_per_node_costs_only_that_worker(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """In place, ``--nproc-per-node 2`` on 2 nodes: a worker SIGKILL leaves the other three
    workers' processes (and their place in the world) alone; the weights are equal."""
    etcd: Any = etcd_or_skip(request)
    steps = STEPS
    with cluster(tmp_path, etcd.endpoint, f"nproc2-{uuid.uuid4().hex[:8]}") as c:
        job = ExampleJob(c, tmp_path / "job", steps=steps, min_nodes=2, max_nodes=2)
        agents = [job.start_node("--nproc-per-node", "2", step_time=STEP_S) for _ in range(2)]
        first = gen = job.trained_in(lambda w, _p: w == 4, "a step in a world of 4")
        job.wait_in_place(4)
        before = {a.pid: sorted(a.worker_pids()) for a in agents}
        victim = before[agents[1].pid][0]
        others = sorted(p for pids in before.values() for p in pids if p != victim)
        os.kill(victim, signal.SIGKILL)
        gen = job.trained_in(lambda w, pids: w == 4 and victim not in pids,
                             "the killed worker's replacement to train in a world of 4",
                             after_gen=gen)
        after = {a.pid: sorted(a.worker_pids()) for a in agents}
        assert after[agents[0].pid] == before[agents[0].pid], (before, after)
        assert set(others) <= set(after[agents[1].pid]) | set(after[agents[0].pid])
        assert len(after[agents[1].pid]) == 2, after
        assert job.steps_done() < steps - 10, "the job ended before the replacement trained"
        audit = job.audit()
        # The three kept their processes and trained in every world since.
        for g, pids in audit.pids_by_gen().items():
            assert g < first or set(others) <= pids, (g, audit.pids_by_gen())
        codes = job.wait_all(agents)
        assert codes == [0, 0], c.logs()
        job.check_audit()

    worst = max_difference(job.weights(), reference_weights(etcd.endpoint, tmp_path, steps))
    assert worst < 1e-9, f"final weights differ from an undisturbed 1-node run's by {worst}"
