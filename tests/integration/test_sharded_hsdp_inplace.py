"""Acceptance of HSDP in place on real ``elastic-run`` agents, a real etcd and real SIGKILLs
(CPU, gloo, float64): replicate 2 x shard 3 on 6 workers (3 nodes x 2), the world going
6 -> 4 -> 6 workers.

Node B's whole process tree is SIGKILLed while the workers train: its ranks 2 and 3 are shard 2 of
replica group 0 and shard 0 of replica group 1, so every shard keeps a replica and the 4
survivors (a 2 x 2 mesh) lose no step. Then a new node joins (a 2 x 3 mesh again).
Checkpoints go to a storage that fails every read once one is committed.

Checks: 0 steps lost per change (printed); the final weights (the final checkpoint, gathered)
equal an undisturbed 1-node run's within 1e-9; every step trained exactly its global batch,
once; the untouched workers' pids are in every world; no recovery read storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip
from tests.integration.training.sharded_job import (
    INTERVAL,
    Outcome,
    ShardedJob,
    check_outcome,
    flags,
    lost_steps,
    no_recovery_read_storage,
    steady_weights,
    wait_progress,
    wait_world,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

STEPS = 16
STEP_TIME = 0.05
FAULT_AFTER = INTERVAL + 1


@pytest.fixture(scope="module")
def outcome(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Outcome, Any]]:
    etcd: Any = etcd_or_skip(request)
    steady = steady_weights(tmp_path_factory.mktemp("hsdp-steady"), etcd.endpoint, STEPS)
    root = tmp_path_factory.mktemp("hsdp")
    with cluster(root, etcd.endpoint, "hsdp-" + root.name[-8:]) as c:
        job = ShardedJob(c, root, flags("1:3", 2), steps=STEPS,
                         worker_flags=("--fail-reads", "--replicate", "2",
                                       "--step-time", str(STEP_TIME)))
        job.open_gate(0)
        a, b, cc = (job.start_node() for _ in range(3))
        wait_world(job, 6)
        # The kill falls while the workers train (steps FAULT_AFTER to FAULT_AFTER + 3),
        # often inside a step: HSDP's world agreement before each optimizer step keeps the
        # survivors at one step (docs/sharded.md), so no step is lost and storage, which
        # refuses reads here, is never needed.
        job.open_gate(FAULT_AFTER + 3)
        wait_progress(job, FAULT_AFTER)
        assert job.committed()
        kept = set(job.workers(a)) | set(job.workers(cc))
        gone = frozenset(job.workers(b))
        b.kill_tree()  # 6 -> 4
        wait_world(job, 4, without=gone)
        job.start_node()  # -> 6
        wait_world(job, 6, without=gone)
        job.open_gate(STEPS)
        job.wait_done([a, cc, *c.agents[3:]])
        yield Outcome(job, job.audit(), kept, job.final_weights()), steady


@pytest.mark.timeout(600)
def test_hsdp_goes_6_to_4_to_6_losing_no_step(outcome: tuple[Outcome, Any]) -> None:
    result, steady = outcome
    lost = check_outcome(result, steady, "hsdp")
    assert lost and all(n == 0 for n in lost), lost
    worlds = [world for _, world, _ in lost_steps(result.audit)]
    assert 4 in worlds and worlds[-1] == 6, worlds
    no_recovery_read_storage(result.audit)
