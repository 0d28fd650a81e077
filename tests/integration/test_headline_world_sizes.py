"""The headline command, as a user runs it: nodes come and go through any world size.

``elastic-run --min-nodes 2 --max-nodes 8 --etcd ... --job-id ... examples/train.py`` on
every node, default flags, the README's example as shipped (script arguments only: float64,
the number of steps, a per-step sleep). Nodes join one at a time until seven train, then
three of them are SIGKILLed (agent and worker), one at a time: the job trains through world
sizes 2, 3, 4, 5, 6, 7, 6, 5, 4 (none of 3, 5, 6, 7 divides the global batch of 64) and then
on to its last step. Its final weights must equal an undisturbed 1-node run's (< 1e-9), the
per-sample audit must show every step's global batch trained exactly once, and every agent
that was not killed must exit 0.

The three nodes that leave are the first three (rank 0, and whichever agent leads, go too).
They are the slow ones (``--step-time``), which paces the job while nodes join; the four
that stay do not sleep, so once they are alone the job runs to its end quickly.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip, kill, tree
from tests.integration.training.example_job import (
    ExampleJob,
    max_difference,
    reference_weights,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 600
SLOW_STEP_S = 0.25  # the three nodes that leave; 600 steps at this pace would take 150 s


def test_nodes_come_and_go_through_any_world_size_with_default_flags(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    etcd: Any = etcd_or_skip(request)
    with cluster(tmp_path, etcd.endpoint, f"headline-{uuid.uuid4().hex[:8]}") as c:
        job = ExampleJob(c, tmp_path / "job", steps=STEPS, min_nodes=2, max_nodes=8)

        def size(n: int, gen: int) -> int:
            return job.trained_in(lambda w, _pids: w == n, f"a step in a world of {n}",
                                  after_gen=gen)

        leaving = [job.start_node(step_time=SLOW_STEP_S) for _ in range(2)]
        gen = size(2, -1)
        job.wait_in_place(2)  # from its first step on: then every change is in place
        leaving.append(job.start_node(step_time=SLOW_STEP_S))
        gen = size(3, gen)
        staying = []
        for n in range(4, 8):  # joins, one at a time
            staying.append(job.start_node())
            gen = size(n, gen)
        reached = job.steps_done()
        assert reached < STEPS - 50, (
            f"the job reached step {reached} of {STEPS} before its nodes left: raise STEPS")
        for n, victim in zip(range(6, 3, -1), leaving, strict=True):  # losses, one at a time
            kill(tree(victim.pid), signal.SIGKILL)
            gen = size(n, gen)
        codes = job.wait_all(staying)
        assert codes == [0] * len(staying), c.logs()

        audit = job.check_audit()
        sizes = [int(g["world"]) for g in sorted(audit.gens, key=lambda g: int(g["gen"]))]
        ordered = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
        it = iter(ordered)  # the worlds trained in this order (a size may repeat: a heal)
        assert all(any(s == e for s in it) for e in [2, 3, 4, 5, 6, 7, 6, 5, 4]), ordered
        assert {int(g["world"]) for g in audit.gens
                if int(g["gen"]) == max(int(x["gen"]) for x in audit.gens)} == {4}

    worst = max_difference(job.weights(), reference_weights(etcd.endpoint, tmp_path, STEPS))
    assert worst < 1e-9, f"final weights differ from an undisturbed 1-node run's by {worst}"
