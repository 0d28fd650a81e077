"""Acceptance 1, 2 and 4 of the training loop under the real launcher.

``elastic-run`` agents on 127.0.0.1 share a real etcd; each runs one gloo worker training a
float64 MLP through ``ElasticSampler`` + ``ElasticLoop`` + ``CheckpointManager`` (local dir,
the loop's default ``max_commit_lag``). A node is lost by SIGKILLing its agent's whole process
tree (agent, worker, DataLoader worker) from outside while the worker trains.

* The undisturbed job: 2 agents (``--nnodes 2``), ``STEPS`` steps.
* The elastic job (``--nnodes 1:2``): 2 nodes train; the node of rank 1 is killed mid-epoch
  (2 -> 1, the survivor goes on in a new round); a new node joins (1 -> 2; the workers drain
  on SIGTERM and resume in the next round); the node of rank 0 (the checkpoint coordinator
  and store host) is killed mid-epoch (2 -> 1); the survivor finishes.

Both jobs must end with the same step count and weights within 1e-5; every sample of every
epoch must be trained exactly once among the steps of the final history; and each failure
must redo at most ``checkpoint_interval + max_commit_lag`` steps (measured and printed).

The workers' steps are gated (``--gate-file``) so that training cannot finish while a node is
still starting on a loaded machine; kills happen while the gate is several steps ahead, i.e.
while the workers train freely.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointing import CheckpointManager
from tests.integration.launcher_scripts.harness import (
    Agent,
    Cluster,
    cluster,
    etcd_or_skip,
    wait_until,
)
from tests.integration.training.harness import (
    WORKER,
    Round,
    committed_steps,
    reference_order,
    rounds,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]
logger = logging.getLogger(__name__)

STEPS, INTERVAL, GLOBAL_BATCH, DATASET, SEED = 30, 5, 12, 100, 11
COMMIT_LAG = INTERVAL  # ElasticLoop's default max_commit_lag
STEP_TIME = 0.1
# Kill once the round has logged this step (global step index), with the gate ahead of it:
# one step after a save started, so that an uncommitted save is the likely case.
KILL_AFTER = (INTERVAL + 1, 3 * INTERVAL + 1)
GATE_AHEAD = 6
EVENT_TIMEOUT = 60.0


@dataclass
class Job:
    """One training job: its agents, audit, checkpoints and the gate its workers obey."""

    cluster: Cluster
    root: Path
    flags: tuple[str, ...]
    weights: Path = field(init=False)

    def __post_init__(self) -> None:
        self.weights = self.root / "weights.pt"
        self.audit.mkdir(parents=True, exist_ok=True)

    @property
    def audit(self) -> Path:
        return self.root / "audit"

    @property
    def gate(self) -> Path:
        return self.root / "gate"

    def open_gate(self, up_to: int) -> None:
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(up_to))
        os.replace(tmp, self.gate)  # workers never read a half-written number

    def start_node(self, step_time: float) -> Agent:
        args = [
            str(WORKER), "--checkpoint-dir", str(self.root / "ckpt"),
            "--audit-dir", str(self.audit), "--steps", str(STEPS), "--interval", str(INTERVAL),
            "--global-batch", str(GLOBAL_BATCH), "--dataset-size", str(DATASET),
            "--workers", "1", "--step-time", str(step_time), "--gate-file", str(self.gate),
            "--weights-out", str(self.weights),
        ]
        return self.cluster.start_elastic(*self.flags, worker_args=args)

    def rounds(self) -> list[Round]:
        return rounds(self.audit)

    def wait_for(self, pred: Callable[[list[Round]], Round | None], what: str) -> Round:
        found: list[Round] = []

        def check() -> bool:
            hit = pred(self.rounds())
            if hit is not None:
                found.append(hit)
            return hit is not None

        try:
            wait_until(check, EVENT_TIMEOUT, what, give_up=self.cluster.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.cluster.logs()}") from None
        return found[0]

    def agent_of_rank(self, attempt: int, rank: int) -> Agent:
        path = self.audit / f"attempt{attempt}.rank{rank}.jsonl"
        first = json.loads(path.read_text().splitlines()[0])
        return self.cluster.agent_of_pid(int(first["pid"]))


@dataclass
class Outcome:
    steady: Job
    elastic: Job
    kills: list[int]  # attempt (round) each kill happened in
    joins: list[int]  # attempt each join interrupted


def _redone(job: Job, attempt: int) -> tuple[int, int, int]:
    """``(last step completed in attempt, step the next round resumed from, steps redone)``."""
    ordered = job.rounds()
    index = next(i for i, r in enumerate(ordered) if r.attempt == attempt)
    last = ordered[index].last_step
    resumed = ordered[index + 1].resumed_from
    return last, resumed, last + 1 - resumed


def _scenario(tmp: Path, endpoint: str) -> Iterator[Outcome]:
    with (
        cluster(tmp / "steady", endpoint, f"steady-{uuid.uuid4().hex[:8]}") as steady_cluster,
        cluster(tmp / "elastic", endpoint, f"elastic-{uuid.uuid4().hex[:8]}") as elastic_cluster,
    ):
        (tmp / "steady").mkdir(exist_ok=True)
        (tmp / "elastic").mkdir(exist_ok=True)
        steady = Job(steady_cluster, tmp / "steady", ("--nnodes", "2", "--max-restarts", "0"))
        elastic = Job(elastic_cluster, tmp / "elastic", (
            "--nnodes", "1:2", "--max-restarts", "3", "--events-dir", str(tmp / "events")))
        # The undisturbed job runs alongside, ungated and unslowed, to share the start-up time.
        for _ in range(2):
            steady.start_node(step_time=0.0)

        # The gate holds step 0 until both nodes train together (a late node would otherwise
        # join a round that has already run ahead).
        elastic.open_gate(0)
        for _ in range(2):
            elastic.start_node(STEP_TIME)
        kills: list[int] = []
        joins: list[int] = []

        # 1. Two nodes train; the node of rank 1 is lost mid-epoch 0 (2 -> 1).
        pair = elastic.wait_for(
            lambda rs: next((r for r in rs if r.world == 2), None), "a world of 2"
        )
        hold = KILL_AFTER[0] + GATE_AHEAD
        elastic.open_gate(hold)
        doomed = elastic.wait_for(
            lambda rs: next((r for r in rs if r.attempt == pair.attempt
                             and r.last_step >= KILL_AFTER[0]), None),
            f"the world of 2 to complete step {KILL_AFTER[0]}",
        )
        elastic.agent_of_rank(doomed.attempt, 1).kill_tree()
        kills.append(doomed.attempt)

        # 2. The survivor trains alone in a new round up to the gate; a node joins (1 -> 2).
        alone = elastic.wait_for(
            lambda rs: next((r for r in rs if r.attempt > doomed.attempt and r.world == 1
                             and r.last_step >= hold - 1), None),
            "the survivor to train alone",
        )
        elastic.start_node(STEP_TIME)
        joined = elastic.wait_for(
            lambda rs: next((r for r in rs if r.attempt > alone.attempt and r.world == 2), None),
            "the new node to be admitted",
        )
        joins.append(alone.attempt)
        elastic.open_gate(KILL_AFTER[1] + GATE_AHEAD)

        # 3. The node of rank 0 (checkpoint coordinator, store host) is lost mid-epoch 1.
        doomed = elastic.wait_for(
            lambda rs: next((r for r in rs if r.attempt == joined.attempt
                             and r.last_step >= KILL_AFTER[1]), None),
            f"the joined world to complete step {KILL_AFTER[1]}",
        )
        elastic.agent_of_rank(doomed.attempt, 0).kill_tree()
        kills.append(doomed.attempt)

        # 4. The survivor finishes alone.
        elastic.open_gate(STEPS)
        survivors = [a for a in elastic_cluster.agents if a.proc.poll() is None]
        for agent in survivors:
            assert agent.wait(EVENT_TIMEOUT) == 0, elastic_cluster.logs()
        for agent in steady_cluster.agents:
            assert agent.wait(EVENT_TIMEOUT) == 0, steady_cluster.logs()
        yield Outcome(steady, elastic, kills, joins)


@pytest.fixture(scope="module")
def outcome(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outcome]:
    etcd: Any = etcd_or_skip(request)
    yield from _scenario(tmp_path_factory.mktemp("under-elastic-run"), etcd.endpoint)


@pytest.mark.timeout(150)  # includes the module fixture: both jobs, two kills and a join
def test_kills_and_a_join_under_elastic_run_end_with_the_undisturbed_weights(
    outcome: Outcome,
) -> None:
    steady = torch.load(outcome.steady.weights, weights_only=True)
    elastic = torch.load(outcome.elastic.weights, weights_only=True)
    assert steady.keys() == elastic.keys()
    worst = max((steady[k] - elastic[k]).abs().max().item() for k in steady)
    assert worst < 1e-5, f"final weights differ by {worst}"
    for job in (outcome.steady, outcome.elastic):
        latest = CheckpointManager(str(job.root / "ckpt")).latest()
        assert latest is not None and latest.step == STEPS
        assert sorted(committed_steps(job.audit)) == list(range(STEPS))
    worlds = [r.world for r in outcome.elastic.rounds()]
    assert len(outcome.kills) == 2 and len(outcome.joins) == 1
    assert worlds[-1] == 1 and 2 in worlds, worlds


@pytest.mark.timeout(30)
def test_every_sample_of_every_epoch_is_trained_once_under_elastic_run(
    outcome: Outcome,
) -> None:
    trained = committed_steps(outcome.elastic.audit)
    assert sorted(trained) == list(range(STEPS))
    stream = [
        i for epoch in range(STEPS * GLOBAL_BATCH // DATASET + 1)
        for i in reference_order(DATASET, SEED, epoch)
    ]
    for step in range(STEPS):
        expected = stream[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        assert Counter(trained[step]) == Counter(expected), f"step {step}"
    counts = Counter(i for ids in trained.values() for i in ids)
    full_epochs, partial = divmod(STEPS * GLOBAL_BATCH, DATASET)
    last_epoch = set(reference_order(DATASET, SEED, full_epochs)[:partial])
    for index in range(DATASET):
        assert counts[index] == full_epochs + (index in last_epoch), f"sample {index}"


@pytest.mark.timeout(30)
def test_each_failure_under_elastic_run_redoes_at_most_interval_plus_commit_lag_steps(
    outcome: Outcome,
) -> None:
    bound = INTERVAL + COMMIT_LAG
    report = []
    for kind, attempts in (("kill", outcome.kills), ("join", outcome.joins)):
        for attempt in attempts:
            last, resumed, redone = _redone(outcome.elastic, attempt)
            report.append(f"{kind}: last step {last}, resumed from {resumed}, redone {redone}")
            assert 0 <= redone <= bound, report[-1]
    redone_by_kills = [_redone(outcome.elastic, a)[2] for a in outcome.kills]
    summary = (
        f"lost work per failure under elastic-run (interval {INTERVAL}, max_commit_lag "
        f"{COMMIT_LAG}, bound {bound}): {redone_by_kills} steps; " + "; ".join(report)
    )
    logger.warning(summary)
    print(f"\n{summary}", file=sys.stderr)


@pytest.mark.timeout(30)
def test_restarts_under_elastic_run_restore_from_the_nodes_memory(outcome: Outcome) -> None:
    # Every committed save is also held by its node's agent and a peer's; a restore of
    # storage's newest checkpoint reads those copies (checkpointing/memory_tier.py). A kill
    # lands one step after a save started, so the newest committed save was copied long ago.
    from elastic.eventlog import read_events

    events = outcome.elastic.root.parent / "events"
    restores = [e for e in read_events(events) if e["event"] == "restored" and e["found"]]
    assert restores, "no restore from a checkpoint was recorded"
    assert {e.get("read_from") for e in restores} <= {"memory", "storage", "mixed"}
    assert any(e.get("read_from") == "memory" for e in restores), restores

