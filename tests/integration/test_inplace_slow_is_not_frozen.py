"""A slow worker is not a frozen one: no false eviction.

Issue 25, item 6: a frozen (SIGSTOPped) worker is now replaced within about a second (its
heartbeat is silent and the kernel reports it stopped), far sooner than the lease TTL. A
worker that is merely slow must keep its process: here one rank of a two-node job in place
(default flags) holds the GIL for 1.5 s (a garbage-collection pause: its heartbeat thread
cannot run, so its agent hears nothing) and then makes that step ten times the median.

Checks: no agent replaced or evicted a worker (no "sent no heartbeat", no eviction, the same
worker processes from start to end), every sample trained exactly once, both agents exit 0.
"""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip
from tests.integration.training.inplace_audit import check_exactly_once
from tests.integration.training.inplace_job import DATASET, GLOBAL_BATCH, SEED, InPlaceJob

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 60
STEP_TIME = 0.05


def test_a_gc_pause_and_a_slow_step_do_not_cost_a_worker(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    etcd: Any = etcd_or_skip(request)
    with cluster(tmp_path, etcd.endpoint, f"slow-{uuid.uuid4().hex[:8]}") as c:
        job = InPlaceJob(c, tmp_path, ("--nnodes", "2"), STEPS,
                         worker_args=("--pause-rank", "1", "--pause-at", "15",
                                      "--gil-pause", "1.5", "--slow-step",
                                      str(10 * STEP_TIME)))
        job.open_gate(STEPS)
        agents = [job.start_node(STEP_TIME) for _ in range(2)]
        codes = [a.wait(150) for a in agents]
        assert codes == [0, 0], c.logs()
        logs = "".join(a.output() for a in agents)
        assert "sent no heartbeat" not in logs, c.logs()
        assert "evict" not in logs.lower(), c.logs()
        audit = job.audit()
        pids = {int(g["pid"]) for g in audit.gens}
        assert len(pids) == 2, f"a worker was replaced: {sorted(pids)}\n{c.logs()}"
        gaps = _longest_gap(audit.done)
        assert gaps >= 1.5, f"the pause did not happen (longest gap {gaps:.2f} s)"
        check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                           seed=SEED)


def _longest_gap(done: list[dict[str, Any]]) -> float:
    times = sorted(float(d["t"]) for d in done)
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)
