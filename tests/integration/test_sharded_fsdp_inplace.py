"""Acceptance of FSDP2 in place on real ``elastic-run`` agents, a real etcd and real SIGKILLs
(CPU, gloo, float64).

The worker (``training/sharded_worker.py``) trains a 4-block transformer, ``fully_shard`` per
block, through the managed ``ElasticLoop(parallelize=...)``, with the per-sample audit on.

* **Faults covered by the peer copies** (3 nodes x 2 workers, copies refreshed every ``K``
  steps, checkpoints on a storage that fails every read once one is committed): a worker
  SIGKILLed (its agent starts a replacement), a node's whole process tree SIGKILLed, then a
  new node joining.
* **Both holders of one shard** killed together (3 nodes x 1 worker: a worker and the worker
  keeping its copy, on the next node): the one loss the copies cannot cover ends in a
  restore from storage (ordinary storage here). This job's script is written the explicit
  way (``for step in loop``, ``loop.step_guard()``, ``loop.module``, ``loop.optimizer``).

Checks: the final weights (the final checkpoint, gathered into full tensors) equal an
undisturbed 1-node run's within 1e-9; every step trained exactly its global batch, once; the
untouched workers' pids are in every world; with the copies no recovery read storage (the job
finished on failing reads; nobody's storage-load count grew after its start) and the steps
each change rolled back, printed, are at most ``K`` (0 on a join); with both holders gone the
survivor restored from storage.
"""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip, kill
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

STEPS = 28  # headroom: a gate releases every step while a change is pending (a late joiner)
K = 3  # peer copies refreshed every K steps
STEP_TIME = 0.05
FAULT_AFTER = INTERVAL + 1  # the first checkpoint is committed: reads fail from then on


@pytest.fixture(scope="module")
def endpoint(request: pytest.FixtureRequest) -> str:
    etcd: Any = etcd_or_skip(request)
    return str(etcd.endpoint)


@pytest.fixture(scope="module")
def steady(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return steady_weights(tmp_path_factory.mktemp("fsdp-steady"), endpoint, STEPS)


@pytest.fixture(scope="module")
def covered(endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    root = tmp_path_factory.mktemp("fsdp-covered")
    with cluster(root, endpoint, "fsdp-" + root.name[-8:]) as c:
        job = ShardedJob(c, root, flags("1:3", 2), steps=STEPS,
                         worker_flags=("--fail-reads", "--snapshot-every", str(K),
                                       "--step-time", str(STEP_TIME)))
        job.open_gate(0)
        a, b, lost_node = (job.start_node() for _ in range(3))
        wait_world(job, 6)
        job.open_gate(FAULT_AFTER + 3)
        wait_progress(job, FAULT_AFTER)
        assert job.committed()
        victim, spared = job.workers(b)
        kept = {*job.workers(a), spared}  # no fault touches them
        kill([victim], signal.SIGKILL)  # 1: a worker; its agent starts a replacement
        wait_world(job, 6, without=frozenset({victim}))
        job.open_gate(FAULT_AFTER + 7)
        wait_progress(job, FAULT_AFTER + 5)
        gone = frozenset(job.workers(lost_node))
        lost_node.kill_tree()  # 2: a node's whole process tree
        wait_world(job, 4, without=gone)
        job.start_node()  # 3: a node joins
        wait_world(job, 6, without=gone)
        job.open_gate(STEPS)
        job.wait_done([a, b, *c.agents[3:]])
        yield Outcome(job, job.audit(), kept, job.final_weights())


@pytest.fixture(scope="module")
def both_holders(endpoint: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    root = tmp_path_factory.mktemp("fsdp-holders")
    with cluster(root, endpoint, "holders-" + root.name[-8:]) as c:
        job = ShardedJob(c, root, flags("1:3", 1), steps=STEPS,
                         worker_flags=("--snapshot-every", str(K), "--explicit",
                                       "--step-time", str(STEP_TIME)))
        job.open_gate(0)
        a, b, cc = (job.start_node() for _ in range(3))
        wait_world(job, 3)
        job.open_gate(FAULT_AFTER + 3)
        wait_progress(job, FAULT_AFTER)
        kept = set(job.workers(a))
        # Rank 1's copy is kept by rank 2 (the next node): both die at once.
        killed = job.workers(b) + job.workers(cc)
        kill(killed, signal.SIGKILL)
        wait_world(job, 3, without=frozenset(killed))
        job.open_gate(STEPS)
        job.wait_done([a, b, cc])
        yield Outcome(job, job.audit(), kept, job.final_weights())


@pytest.mark.timeout(600)
def test_fsdp_survives_a_worker_a_node_and_a_join_in_place(
        steady: dict[str, torch.Tensor], covered: Outcome) -> None:
    lost = check_outcome(covered, steady, "fsdp")
    assert all(n <= K for n in lost), lost
    no_recovery_read_storage(covered.audit)
    changes = lost_steps(covered.audit)
    joins = [n for (_, before, _), (_, after, n) in itertools.pairwise(changes)
             if after > before]
    assert joins and all(n == 0 for n in joins), changes


@pytest.mark.timeout(600)
def test_losing_both_holders_of_a_shard_restores_from_storage(
        steady: dict[str, torch.Tensor], both_holders: Outcome) -> None:
    check_outcome(both_holders, steady, "fsdp, both holders")
    (survivor,) = both_holders.kept_pids
    loads = [int(g["storage_loads"]) for g in both_holders.audit.gens
             if int(g["pid"]) == survivor]
    assert loads[0] == 1 and loads[-1] == 2, loads  # the fresh start, then the restore
