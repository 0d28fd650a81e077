"""Acceptance 1, 2 and 4 of the training loop with real worker processes (gloo, torchrun).

One job runs undisturbed on 2 workers; the same job runs with a worker SIGKILLed mid-epoch
(world 2), resumed on 1 worker which is SIGKILLed again, then resumed on 2 workers (a join).
Each launch is a fresh torchrun round, as after a membership change; state comes only from the
committed checkpoints. The same acceptance under elastic-run, with agents on a real etcd and
whole nodes killed from outside, is ``test_training_under_elastic_run.py``.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointManager
from tests.integration.training.harness import (
    Attempt,
    committed_steps,
    reference_order,
    run_attempt,
)

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

STEPS, INTERVAL, GLOBAL_BATCH, DATASET, SEED = 30, 5, 12, 100, 11
# The elastic run waits for every commit before its next step (max_commit_lag=0), so a failure
# redoes at most one interval; test_training_under_elastic_run.py covers the default lag.
COMMIT_LAG = 0
DRAINED_EXIT_CODE = 143


class Scenario:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.steady_weights = root / "steady.pt"
        self.elastic_weights = root / "elastic.pt"
        self.audit = root / "audit"
        self.attempts: list[Attempt] = []
        self.kill_steps = [13, 22]

    def common(self, name: str) -> list[str]:
        return [
            "--checkpoint-dir", str(self.root / name / "ckpt"), "--steps", str(STEPS),
            "--interval", str(INTERVAL), "--global-batch", str(GLOBAL_BATCH),
            "--dataset-size", str(DATASET),
        ]

    def run(self) -> None:
        steady = run_attempt(
            2, *self.common("steady"), "--audit-dir", str(self.root / "steady-audit"),
            "--weights-out", str(self.steady_weights),
        )
        assert steady.returncode == 0, steady.output[-3000:]
        elastic = [*self.common("elastic"), "--audit-dir", str(self.audit), "--workers", "2",
                   "--commit-lag", str(COMMIT_LAG)]
        plan = [
            (2, ["--die-at", "13", "--die-rank", "1"]),  # a worker lost mid-epoch: 2 -> 1
            (1, ["--die-at", "22", "--die-rank", "0"]),  # the survivor lost too
            (2, ["--weights-out", str(self.elastic_weights)]),  # a node joins: 1 -> 2
        ]
        for attempt, (nproc, extra) in enumerate(plan):
            result = run_attempt(nproc, *elastic, "--attempt", str(attempt), *extra)
            self.attempts.append(result)
            if attempt < len(plan) - 1:
                assert result.returncode != 0, result.output[-3000:]
            else:
                assert result.returncode == 0, result.output[-3000:]


# Seven torchrun launches of two workers each: ~10 s apiece on a busy 2-core machine.
@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    result = Scenario(tmp_path_factory.mktemp("training"))
    result.run()
    return result


@pytest.mark.timeout(300)  # includes the module fixture's four launches
def test_kills_and_a_join_end_with_the_undisturbed_weights_and_step_count(
    scenario: Scenario,
) -> None:
    steady = torch.load(scenario.steady_weights, weights_only=True)
    elastic = torch.load(scenario.elastic_weights, weights_only=True)
    assert steady.keys() == elastic.keys()
    worst = max((steady[k] - elastic[k]).abs().max().item() for k in steady)
    assert worst < 1e-5, f"final weights differ by {worst}"
    assert f"stopped at step {STEPS} drained=False" in scenario.attempts[-1].output
    latest = CheckpointManager(str(scenario.root / "elastic" / "ckpt")).latest()
    assert latest is not None and latest.step == STEPS


def test_every_sample_of_every_epoch_is_trained_exactly_once_across_kills_and_a_join(
    scenario: Scenario,
) -> None:
    trained = committed_steps(scenario.audit)
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


def test_each_failure_redoes_at_most_one_interval_when_each_commit_is_awaited(
    scenario: Scenario,
) -> None:
    # The bound is interval + max_commit_lag. With the default lag (the interval) a kill after
    # step 13 resumed from step 5 under CI load, as the save of step 10 had not committed yet;
    # with lag 0 the loop waits for that commit before step 10 runs, so it resumes from 10.
    bound = INTERVAL + COMMIT_LAG
    redone = []
    for killed_at, resumed in zip(scenario.kill_steps, scenario.attempts[1:], strict=True):
        lost = killed_at + 1 - resumed.resumed_from
        redone.append(lost)
        assert 0 <= lost <= bound, f"killed after step {killed_at}, resumed at {resumed}"
    logger.warning("steps redone per failure (interval %d): %s", INTERVAL, redone)
    print(f"\nlost work per failure (checkpoint interval {INTERVAL}): {redone} steps")


@pytest.mark.timeout(200)
def test_sigterm_on_one_rank_drains_every_rank_with_a_final_checkpoint(tmp_path: Path) -> None:
    args = [
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--audit-dir", str(tmp_path / "audit"),
        "--interval", str(INTERVAL), "--global-batch", str(GLOBAL_BATCH),
        "--dataset-size", str(DATASET),
    ]
    first = run_attempt(2, *args, "--steps", "30", "--term-at", "7", "--term-rank", "0",
                        "--step-time", "0.02")
    # SIGTERM lands in step 7; every rank agrees on it at the same later step (the agreement
    # is an asynchronous all-reduce, about one every 50 ms when steps are short, read at the
    # next one), drains there with a final checkpoint, and stops well before the end. Each
    # step takes at least 20 ms: steps of a few ms (a quiet machine) ran all 23 remaining
    # steps before an agreement came, and the job ended undrained (a CI rehearsal).
    stops = {int(rank): int(step) for rank, step in re.findall(
        r"rank=(\d) stopped at step (\d+) drained=True", first.output)}
    assert set(stops) == {0, 1} and stops[0] == stops[1], first.output[-3000:]
    stop = stops[0]
    assert 8 <= stop < 30, first.output[-3000:]
    latest = CheckpointManager(str(tmp_path / "ckpt")).latest()
    assert latest is not None and latest.step == stop
    second = run_attempt(1, *args, "--steps", str(stop + 1), "--attempt", "1")
    assert second.returncode == 0, second.output[-3000:]
    assert second.resumed_from == stop
