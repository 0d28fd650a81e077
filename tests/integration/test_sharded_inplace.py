"""Acceptance of sharded models in place (FSDP2 and HSDP) on real ``elastic-run`` agents, a
real etcd and real SIGKILLs, on CPU with gloo and float64.

The worker (``training/sharded_worker.py``) trains a 4-block transformer, ``fully_shard`` per
block, through the managed ``ElasticLoop(parallelize=...)`` with the per-sample audit on.
Every scenario is compared with one undisturbed run (1 node, 1 worker).

* **FSDP**, 3 nodes x 2 workers, peer copies refreshed every ``K`` steps, checkpoints on a
  storage that fails every read after the first save: a worker SIGKILLed (its agent starts a
  replacement), a node's whole process tree SIGKILLed, then a new node joining.
* **HSDP**, replicate 2 x shard 3 on 6 workers (3 nodes x 2), the same storage: a node's tree
  SIGKILLed (6 -> 4 workers, a 2 x 2 mesh), then a node joining (-> 6): 0 steps lost.
* **Both holders of one shard** killed together (3 nodes x 1 worker: a worker and the worker
  keeping its copy): the only loss the copies cannot cover ends in a storage restore.

Checks: final weights (the final checkpoint, gathered into full tensors) equal the undisturbed
run's within 1e-9; every step trained exactly its global batch, once; the untouched workers'
pids are in every world; no recovery read storage (the job finished on failing reads; every
worker's storage loads are its fresh start's only) except where storage is the only way; the
steps each change rolled back, printed: at most ``K`` with copies, 0 with HSDP and on a join.
"""

from __future__ import annotations

import itertools
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip, kill
from tests.integration.training.inplace_audit import Audit, check_exactly_once
from tests.integration.training.sharded_job import (
    DATASET,
    GLOBAL_BATCH,
    INTERVAL,
    SEED,
    ShardedJob,
    current_world,
    lost_steps,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

STEPS = 24
K = 3  # peer copies refreshed every K steps
STEP_TIME = 0.05
FAULT_AFTER = INTERVAL + 1  # the first checkpoint is committed: reads fail from then on


@dataclass
class Outcome:
    job: ShardedJob
    audit: Audit
    kept_pids: set[int]  # workers no fault touched
    weights: dict[str, torch.Tensor]


def _flags(nodes: str, per_node: int) -> tuple[str, ...]:
    return ("--nnodes", nodes, "--nproc-per-node", str(per_node), "--max-restarts", "3",
            "--inplace-ttl", "3")


def _wait_progress(job: ShardedJob, past: int, what: str) -> None:
    job.wait_for(lambda a: any(int(d["step"]) >= past for d in a.done), what)


def _wait_world(job: ShardedJob, size: int, without: set[int] = frozenset(),  # type: ignore[assignment]
                ) -> set[int]:
    def ready(a: Audit) -> set[int] | None:
        _gen, pids = current_world(a)
        return pids if len(pids) == size and not pids & without else None

    found: set[int] = job.wait_for(ready, f"a world of {size} without {sorted(without)}")
    return found


@pytest.fixture(scope="module")
def steady(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    etcd: Any = etcd_or_skip(request)
    root = tmp_path_factory.mktemp("sharded-steady")
    with cluster(root, etcd.endpoint, f"steady-{uuid.uuid4().hex[:8]}") as c:
        job = ShardedJob(c, root, _flags("1", 1), steps=STEPS)
        agent = job.start_node()
        job.wait_done([agent])
        return job.final_weights()


def _compare(weights: dict[str, torch.Tensor], steady: dict[str, torch.Tensor]) -> float:
    assert weights.keys() == steady.keys()
    return max((weights[k] - steady[k]).abs().max().item() for k in steady)


def _fsdp(root: Path, endpoint: str) -> Iterator[Outcome]:
    with cluster(root, endpoint, f"fsdp-{uuid.uuid4().hex[:8]}") as c:
        job = ShardedJob(c, root, _flags("1:3", 2), steps=STEPS,
                         worker_flags=("--fail-reads", "--snapshot-every", str(K),
                                       "--step-time", str(STEP_TIME)))
        job.open_gate(0)
        a, b, cc = (job.start_node() for _ in range(3))
        _wait_world(job, 6)
        job.open_gate(FAULT_AFTER + 3)
        _wait_progress(job, FAULT_AFTER, f"step {FAULT_AFTER}")
        assert job.committed()
        kept = set(job.workers(a))
        victim, spared = job.workers(b)
        kill([victim], signal.SIGKILL)  # 1: a worker; its agent starts a replacement
        _wait_world(job, 6, without={victim})
        job.open_gate(FAULT_AFTER + 7)
        _wait_progress(job, FAULT_AFTER + 5, "training after the worker's replacement")
        kept.add(spared)
        lost = set(job.workers(cc))
        cc.kill_tree()  # 2: a node's whole process tree
        _wait_world(job, 4, without=lost)
        job.start_node()  # 3: a node joins
        _wait_world(job, 6, without=lost)
        job.open_gate(STEPS)
        job.wait_done([a, b, *c.agents[3:]])
        yield Outcome(job, job.audit(), kept, job.final_weights())


def _hsdp(root: Path, endpoint: str) -> Iterator[Outcome]:
    with cluster(root, endpoint, f"hsdp-{uuid.uuid4().hex[:8]}") as c:
        job = ShardedJob(c, root, _flags("1:3", 2), steps=STEPS,
                         worker_flags=("--fail-reads", "--replicate", "2",
                                       "--step-time", str(STEP_TIME)))
        job.open_gate(0)
        a, b, cc = (job.start_node() for _ in range(3))
        _wait_world(job, 6)
        job.open_gate(FAULT_AFTER + 3)
        _wait_progress(job, FAULT_AFTER, f"step {FAULT_AFTER}")
        assert job.committed()
        kept = set(job.workers(a)) | set(job.workers(cc))
        lost = set(job.workers(b))
        b.kill_tree()  # 6 -> 4: ranks 2 and 3 are shard 2 of replica 0 and shard 0 of 1
        _wait_world(job, 4, without=lost)
        job.start_node()  # -> 6
        _wait_world(job, 6, without=lost)
        job.open_gate(STEPS)
        job.wait_done([a, cc, *c.agents[3:]])
        yield Outcome(job, job.audit(), kept, job.final_weights())


def _both_holders(root: Path, endpoint: str) -> Iterator[Outcome]:
    with cluster(root, endpoint, f"holders-{uuid.uuid4().hex[:8]}") as c:
        job = ShardedJob(c, root, _flags("1:3", 1), steps=STEPS,
                         worker_flags=("--snapshot-every", str(K),
                                       "--step-time", str(STEP_TIME)))
        job.open_gate(0)
        a, b, cc = (job.start_node() for _ in range(3))
        _wait_world(job, 3)
        job.open_gate(FAULT_AFTER + 3)
        _wait_progress(job, FAULT_AFTER, f"step {FAULT_AFTER}")
        kept = set(job.workers(a))
        # Rank 1's copy is kept by rank 2 (the next node): both die at once.
        kill(job.workers(b) + job.workers(cc), signal.SIGKILL)
        time.sleep(0.5)
        _wait_world(job, 3, without=set())
        job.open_gate(STEPS)
        job.wait_done([a, b, cc])
        yield Outcome(job, job.audit(), kept, job.final_weights())


@pytest.fixture(scope="module")
def fsdp(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _fsdp(tmp_path_factory.mktemp("sharded-fsdp"), etcd.endpoint)


@pytest.fixture(scope="module")
def hsdp(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _hsdp(tmp_path_factory.mktemp("sharded-hsdp"), etcd.endpoint)


@pytest.fixture(scope="module")
def both_holders(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _both_holders(tmp_path_factory.mktemp("sharded-holders"), etcd.endpoint)


def _check(outcome: Outcome, steady: dict[str, torch.Tensor], name: str) -> list[int]:
    audit = outcome.audit
    worst = _compare(outcome.weights, steady)
    changes = lost_steps(audit)
    print(f"\n[{name}] lost steps per change (generation, world, steps): {changes}; final "
          f"weights differ from the undisturbed run's by {worst:.3g}")
    assert worst < 1e-9, f"final weights differ by {worst}"
    check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                       seed=SEED)
    by_gen = audit.pids_by_gen()
    for pid in outcome.kept_pids:
        assert all(pid in pids for pids in by_gen.values()), f"worker {pid} missed a world"
    return [lost for _, _, lost in changes]


def _storage_loads(audit: Audit) -> tuple[dict[int, list[int]], set[int]]:
    """Each worker's storage-load counts, generation by generation, and the pids of the
    first world (the others joined later)."""
    loads: dict[int, list[int]] = {}
    for g in audit.gens:
        loads.setdefault(int(g["pid"]), []).append(int(g["storage_loads"]))
    first = min(int(g["gen"]) for g in audit.gens)
    return loads, {int(g["pid"]) for g in audit.gens if int(g["gen"]) == first}


def _no_recovery_read_storage(audit: Audit) -> None:
    loads, founders = _storage_loads(audit)
    for pid, counts in loads.items():
        # The first world's workers read storage once, to start (there was no checkpoint);
        # every later worker got its state from the others.
        assert counts == [1 if pid in founders else 0] * len(counts), (pid, counts)
    for g in audit.gens:
        if int(g["pid"]) not in founders and g is next(
                x for x in audit.gens if x["pid"] == g["pid"]):
            assert g["received"], f"newcomer {g['pid']} trained without receiving state"
    assert len(loads) > len(founders), "no worker joined"


@pytest.mark.timeout(900)
def test_fsdp_survives_a_worker_a_node_and_a_join_in_place(
        steady: dict[str, torch.Tensor], fsdp: Outcome) -> None:
    lost = _check(fsdp, steady, "fsdp")
    assert all(n <= K for n in lost), lost
    _no_recovery_read_storage(fsdp.audit)
    changes = lost_steps(fsdp.audit)
    joins = [n for (_, before, _), (_, after, n) in itertools.pairwise(changes)
             if after > before]
    assert joins and all(n == 0 for n in joins), changes


@pytest.mark.timeout(900)
def test_hsdp_goes_6_to_4_to_6_losing_no_step(steady: dict[str, torch.Tensor],
                                              hsdp: Outcome) -> None:
    lost = _check(hsdp, steady, "hsdp")
    assert lost and all(n == 0 for n in lost), lost
    worlds = [world for _, world, _ in lost_steps(hsdp.audit)]
    assert 4 in worlds and worlds[-1] == 6, worlds
    _no_recovery_read_storage(hsdp.audit)


@pytest.mark.timeout(900)
def test_losing_both_holders_of_a_shard_restores_from_storage(
        steady: dict[str, torch.Tensor], both_holders: Outcome) -> None:
    _check(both_holders, steady, "both holders")
    (survivor,) = both_holders.kept_pids
    loads = [int(g["storage_loads"]) for g in both_holders.audit.gens
             if int(g["pid"]) == survivor]
    assert loads[-1] == 2, loads  # the fresh start, then the restore
