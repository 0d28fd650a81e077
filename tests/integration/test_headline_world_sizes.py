"""The headline command, as a user runs it: nodes come and go through any world size.

``elastic-run --min-nodes 2 --max-nodes 8 --etcd ... --job-id ... examples/train.py`` on
every node, default flags, the README's example unchanged (float64 and a little step time
only). Nodes join one at a time until seven train, then leave one at a time (SIGKILL of the
whole node) down to four: the job trains through world sizes 2, 3, 4, 5, 6, 7, 6, 5, 4
(none of 3, 5, 6, 7 divides the global batch of 64). Then every agent gets SIGTERM and the
job drains with a final checkpoint. Its weights must equal an undisturbed 1-node run of the
same number of steps, and the per-sample audit (``ELASTIC_SAMPLE_AUDIT``) must show every
step's global batch trained exactly once.
"""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState
from tests.integration.launcher_scripts.harness import (
    REPO,
    Agent,
    Cluster,
    cluster,
    etcd_or_skip,
    kill,
    tree,
    wait_until,
)
from tests.integration.training.inplace_audit import check_exactly_once, read_audit

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = REPO / "examples" / "train.py"
GLOBAL_BATCH, DATASET, SEED = 64, 8192, 1234
STEP_TIME = 0.05
WAIT = 240.0


def _launch(c: Cluster, root: Path) -> Agent:
    return c.start(
        ["--min-nodes", "2", "--max-nodes", "8", "--etcd", c.endpoint, "--job-id", c.job_id],
        [str(EXAMPLE), "--dtype", "float64", "--steps", "1000000", "--step-time",
         str(STEP_TIME), "--checkpoint-dir", str(root / "ckpt")],
    )


def _weights(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    state = ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    info = CheckpointManager(str(ckpt), async_mode="disabled").load({"train": state},
                                                                    step=step)
    assert info is not None and info.step == step
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_nodes_come_and_go_through_any_world_size_with_default_flags(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    etcd: Any = etcd_or_skip(request)
    audit_dir = tmp_path / "audit"
    with cluster(tmp_path, etcd.endpoint, f"headline-{uuid.uuid4().hex[:8]}") as c:
        c.env.update(ELASTIC_SAMPLE_AUDIT=str(audit_dir))
        c.env.pop("ELASTIC_MODE", None)

        def trained_in_world(size: int, after_gen: int) -> int:
            """The first generation after ``after_gen`` of ``size`` ranks that completed a
            step (waits for it)."""
            found: list[int] = []

            def check() -> bool:
                audit = read_audit(audit_dir) if audit_dir.exists() else None
                if audit is None:
                    return False
                worlds = {int(g["gen"]): int(g["world"]) for g in audit.gens}
                done = {int(d["gen"]) for d in audit.done}
                hits = sorted(g for g, w in worlds.items()
                              if w == size and g > after_gen and g in done)
                found[:] = hits[:1]
                return bool(hits)

            wait_until(check, WAIT, f"a step in a world of {size}", give_up=c.all_exited)
            return found[0]

        agents = [_launch(c, tmp_path) for _ in range(2)]
        gen = trained_in_world(2, 0)
        for size in range(3, 8):  # joins, one at a time
            agents.append(_launch(c, tmp_path))
            gen = trained_in_world(size, gen)
        for size in range(6, 3, -1):  # node losses, one at a time
            victim = agents.pop(1)  # not the first node: any node may go
            kill(tree(victim.pid), signal.SIGKILL)
            gen = trained_in_world(size, gen)
        for agent in agents:  # the job drains: a final checkpoint on every rank
            kill([agent.pid], signal.SIGTERM)
        codes = [agent.wait(120) for agent in agents]
        assert codes == [143] * len(agents), c.logs()

        audit = read_audit(audit_dir)
        steps = max(audit.final_attempts()) + 1
        sizes = [int(g["world"]) for g in sorted(audit.gens, key=lambda g: int(g["gen"]))]
        ordered = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
        # The worlds trained in order (a world may repeat: a heal or a join's own epoch).
        it = iter(ordered)
        assert all(any(s == e for s in it) for e in [2, 3, 4, 5, 6, 7, 6, 5, 4]), ordered
        check_exactly_once(audit, steps=steps, global_batch=GLOBAL_BATCH, dataset=DATASET,
                           seed=SEED)

    # The undisturbed run: one node, the same number of steps.
    reference = tmp_path / "reference"
    with cluster(reference, etcd.endpoint, f"reference-{uuid.uuid4().hex[:8]}") as r:
        reference.mkdir(exist_ok=True)
        one = r.start(["--standalone", "--nproc-per-node", "1"],
                      [str(EXAMPLE), "--dtype", "float64", "--steps", str(steps),
                       "--checkpoint-dir", str(reference / "ckpt")])
        assert one.wait(600) == 0, r.logs()
    elastic, steady = _weights(tmp_path / "ckpt", steps), _weights(reference / "ckpt", steps)
    worst = max((elastic[k] - steady[k]).abs().max().item() for k in steady)
    assert worst < 1e-9, f"final weights differ by {worst}"
