"""Acceptance 2 of the data-at-scale issue: the sharded stream on 3 nodes, in place, through a
worker kill, a node loss and a join.

``examples/train_stream.py`` (the example as a user runs it: it writes its own JSON-lines
shards, two DataLoader workers per rank) under three ``elastic-run`` agents with default
flags but ``--min-nodes 1`` (so that the survivor trains alone while the others start) on a
real etcd. Node 1's worker is SIGKILLed (its agent starts a replacement, which the
survivors admit in place); while it starts, node 2 is lost (agent, worker and loader workers
SIGKILLed together) and a new node joins. Then every agent gets SIGTERM and the job drains
with a final checkpoint.

Checks: node 0's worker is in every world (in place: never restarted); the per-sample audit
(``ELASTIC_SAMPLE_AUDIT``: the ids the loader delivered) shows every step's global batch of
the stream's order trained exactly once, and each epoch's samples once; every shard was
opened at most once per epoch by every reader (each rank's loader worker, in each world);
the final weights equal an undisturbed run's of the same number of steps (the example's model
and loop in one process, without loader workers).
"""

from __future__ import annotations

import importlib.util
import signal
import uuid
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState
from elastic.stream import ShardedOrder
from tests.integration.launcher_scripts.harness import (
    REPO,
    Agent,
    Cluster,
    cluster,
    etcd_or_skip,
    kill,
    wait_until,
    workers,
)
from tests.integration.training.inplace_audit import Audit, check_exactly_once, read_audit

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLE = REPO / "examples" / "train_stream.py"
SHARDS, PER_SHARD, BUFFER, SEED = 6, 40, 64, 7
GLOBAL_BATCH = 12  # 240 samples: an epoch is 20 steps, so the run crosses several
DATASET = SHARDS * PER_SHARD
STEP_TIME = 0.2  # fewer steps for the reference run to redo
WAIT = 180.0
MIN_STEPS = 2 * DATASET // GLOBAL_BATCH + 5  # into a third epoch before the drain


def _example_args(root: Path) -> list[str]:
    return [str(EXAMPLE), "--dtype", "float64", "--data-dir", str(root / "data"),
            "--shards", str(SHARDS), "--samples-per-shard", str(PER_SHARD),
            "--buffer-size", str(BUFFER), "--seed", str(SEED),
            "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "3",
            "--checkpoint-every", "50"]


def _launch(c: Cluster, root: Path) -> Agent:
    return c.start(
        ["--min-nodes", "1", "--max-nodes", "3", "--etcd", c.endpoint, "--job-id", c.job_id],
        [*_example_args(root), "--steps", "1000000", "--step-time", str(STEP_TIME),
         "--checkpoint-dir", str(root / "ckpt")],
    )


def _weights(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    state = ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    info = CheckpointManager(str(ckpt), async_mode="disabled").load({"train": state},
                                                                    step=step)
    assert info is not None and info.step == step
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _order(epoch: int) -> list[int]:
    """The stream's order of sample ids (shards in the example's list order)."""
    counts = np.full(SHARDS, PER_SHARD, dtype=np.int64)
    return list(ShardedOrder(counts, seed=SEED, epoch=epoch, buffer_size=BUFFER, shuffle=True))


def test_the_stream_trains_exactly_once_through_a_worker_kill_a_node_loss_and_a_join(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    etcd: Any = etcd_or_skip(request)
    audit_dir = tmp_path / "audit"
    with cluster(tmp_path, etcd.endpoint, f"stream-{uuid.uuid4().hex[:8]}") as c:
        c.env.update(ELASTIC_SAMPLE_AUDIT=str(audit_dir))
        c.env.pop("ELASTIC_MODE", None)

        def trained_in(what: str, after_gen: int, ok: Any) -> int:
            """The first generation after ``after_gen`` whose world passes ``ok(pids)`` and
            completed a step (waits for it)."""
            found: list[int] = []

            def check() -> bool:
                audit = read_audit(audit_dir) if audit_dir.exists() else None
                if audit is None:
                    return False
                done = {int(d["gen"]) for d in audit.done}
                hits = sorted(g for g, pids in audit.pids_by_gen().items()
                              if g > after_gen and g in done and ok(pids))
                found[:] = hits[:1]
                return bool(hits)

            try:
                wait_until(check, WAIT, what, give_up=c.all_exited)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{c.logs()}") from None
            return found[0]

        agents = [_launch(c, tmp_path) for _ in range(3)]
        gen = trained_in("a step in a world of 3", 0, lambda pids: len(pids) == 3)
        (survivor,) = workers(agents[0])
        (killed,) = workers(agents[1])
        lost = set(workers(agents[2]))
        kill([killed], signal.SIGKILL)  # a worker kill: its agent starts a replacement
        gen = trained_in("a step without the killed worker", gen,
                         lambda pids: killed not in pids and pids >= {survivor} | lost)
        # While the replacement starts, node 2 is lost (agent, worker and its loader workers
        # at once) and a new node joins: their process starts overlap (a shorter test).
        agents[2].kill_tree()
        agents.append(_launch(c, tmp_path))
        trained_in("the replacement and the new node admitted", gen,
                   lambda pids: len(pids) == 3 and not (lost | {killed}) & pids)
        wait_until(lambda: max(int(d["step"]) for d in read_audit(audit_dir).done) >= MIN_STEPS,
                   WAIT, f"step {MIN_STEPS}", give_up=c.all_exited)
        for agent in (agents[0], agents[1], agents[3]):  # the job drains
            kill([agent.pid], signal.SIGTERM)
        codes = [agents[i].wait(120) for i in (0, 1, 3)]
        assert codes == [143] * 3, c.logs()

    audit = read_audit(audit_dir)
    steps = max(audit.final_attempts()) + 1
    # In place: node 0's worker trained in every world, never restarted.
    assert all(survivor in pids for pids in audit.pids_by_gen().values()), audit.pids_by_gen()
    check_exactly_once(audit, steps=steps, global_batch=GLOBAL_BATCH, dataset=DATASET,
                       seed=SEED, order=_order)
    _check_epochs(audit, steps)
    _check_shard_opens(audit)

    # The undisturbed run: the example's own model and loop, in this process, without
    # loader workers, for the same number of steps.
    example = _example()
    args = example.parse_args([*_example_args(tmp_path)[1:], "--steps", str(steps),
                               "--loader-workers", "0",
                               "--checkpoint-dir", str(tmp_path / "reference")])
    model, loop = example.build(args, None)
    example.train(args, loop, leader=False)
    assert loop.finished and loop.resumed_from == 0
    steady = {k: v.detach() for k, v in model.state_dict().items()}
    elastic = _weights(tmp_path / "ckpt", steps)
    worst = max((elastic[k] - steady[k]).abs().max().item() for k in steady)
    assert worst < 1e-9, f"final weights differ by {worst}"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_stream_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_epochs(audit: Audit, steps: int) -> None:
    """The ids the loaders delivered in the final attempt of each step: each epoch's once."""
    final = audit.final_attempts()
    ids: dict[int, list[int]] = {}
    for b in audit.batches:
        step = int(b["step"])
        if step < steps and int(b["gen"]) == final[step]:
            ids.setdefault(step * GLOBAL_BATCH // DATASET, []).extend(int(i) for i in b["ids"])
    epochs = steps * GLOBAL_BATCH // DATASET
    assert epochs >= 1, f"only {steps} steps: not a whole epoch"
    for epoch in range(epochs):
        assert Counter(ids[epoch]) == Counter(range(DATASET)), f"epoch {epoch}"


def _check_shard_opens(audit: Audit) -> None:
    assert audit.opens, "no shard opens were logged"
    assert {int(o["worker"]) for o in audit.opens} == {0, 1}  # the loader workers read
    per_reader = Counter((o["reader"], int(o["epoch"]), int(o["shard"])) for o in audit.opens)
    twice = {k: n for k, n in per_reader.items() if n > 1}
    assert not twice, f"shards opened more than once per epoch by a reader: {twice}"
