"""A job of ``sharded_worker.py`` under real ``elastic-run --elastic-mode inplace`` agents,
and what its audit and final checkpoint say."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic.loop.audit import AUDIT_ENV
from tests.integration.launcher_scripts.harness import Agent, Cluster, wait_until, workers
from tests.integration.training.inplace_audit import Audit, read_audit

WORKER = Path(__file__).with_name("sharded_worker.py")
GLOBAL_BATCH, DATASET, SEED, INTERVAL = 12, 100, 11, 4
EVENT_TIMEOUT = 90.0


@dataclass
class ShardedJob:
    """The agents of one job and the files its workers write under ``root``."""

    cluster: Cluster
    root: Path
    flags: tuple[str, ...]
    worker_flags: tuple[str, ...] = ()
    steps: int = 16

    def __post_init__(self) -> None:
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.cluster.env[AUDIT_ENV] = str(self.audit_dir)

    @property
    def audit_dir(self) -> Path:
        return self.root / "audit"

    @property
    def checkpoints(self) -> Path:
        return self.root / "ckpt"

    @property
    def gate(self) -> Path:
        return self.root / "gate"

    def open_gate(self, up_to: int) -> None:
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(up_to))
        os.replace(tmp, self.gate)

    def start_node(self, *extra: str) -> Agent:
        args = [str(WORKER), "--checkpoint-dir", str(self.checkpoints), "--steps",
                str(self.steps), "--interval", str(INTERVAL), "--global-batch",
                str(GLOBAL_BATCH), "--dataset-size", str(DATASET), "--gate-file",
                str(self.gate), *self.worker_flags]
        return self.cluster.start_elastic("--elastic-mode", "inplace", *self.flags, *extra,
                                          worker_args=args)

    def audit(self) -> Audit:
        return read_audit(self.audit_dir)

    def wait_for(self, pred: Callable[[Audit], Any], what: str,
                 timeout: float = EVENT_TIMEOUT) -> Any:
        found: list[Any] = []

        def check() -> bool:
            hit = pred(self.audit())
            if hit:
                found.append(hit)
            return bool(hit)

        try:
            wait_until(check, timeout, what, give_up=self.cluster.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.cluster.logs()}") from None
        return found[0]

    def wait_done(self, agents: list[Agent]) -> None:
        for agent in agents:
            assert agent.wait(EVENT_TIMEOUT * 2) == 0, self.cluster.logs()

    def workers(self, agent: Agent) -> list[int]:
        return workers(agent)

    def committed(self) -> bool:
        return any(self.checkpoints.glob("step-*/COMMIT.json"))

    def final_weights(self) -> dict[str, torch.Tensor]:
        """The model of the newest committed checkpoint, gathered into full tensors."""
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        newest = max(p.parent for p in self.checkpoints.glob("step-*/COMMIT.json"))
        out = self.root / "final.pt"
        dcp_to_torch_save(str(newest), str(out))
        state = torch.load(out, weights_only=False)
        return dict(state["train"]["model"])


def current_world(audit: Audit) -> tuple[int, set[int]]:
    """The newest generation and the pids that logged it."""
    by_gen = audit.pids_by_gen()
    if not by_gen:
        return -1, set()
    gen = max(by_gen)
    return gen, by_gen[gen]


def lost_steps(audit: Audit) -> list[tuple[int, int, int]]:
    """``(generation, world size, completed steps it trained again)`` of every generation after
    the first: how far each change rolled the job back."""
    out = []
    gens = sorted(audit.pids_by_gen())
    for gen in gens[1:]:
        before = [int(d["step"]) + 1 for d in audit.done if int(d["gen"]) < gen]
        start = min(int(g["step"]) for g in audit.gens if int(g["gen"]) == gen)
        out.append((gen, audit.world_of(gen), max(0, max(before, default=0) - start)))
    return out


@dataclass
class Outcome:
    """A finished job: its audit, the workers no fault touched, its final weights."""

    job: ShardedJob
    audit: Audit
    kept_pids: set[int]
    weights: dict[str, torch.Tensor]


def flags(nodes: str, per_node: int) -> tuple[str, ...]:
    """The agents' flags of a job of ``nodes`` nodes with ``per_node`` workers each."""
    return ("--nnodes", nodes, "--nproc-per-node", str(per_node), "--max-restarts", "3",
            "--inplace-ttl", "3")


def wait_progress(job: ShardedJob, past: int) -> None:
    """Waits until some worker completed step ``past``."""
    job.wait_for(lambda a: any(int(d["step"]) >= past for d in a.done), f"step {past}")


def wait_world(job: ShardedJob, size: int, without: frozenset[int] = frozenset()) -> set[int]:
    """Waits for a newest world of ``size`` workers, none of them in ``without``."""
    def ready(a: Audit) -> set[int] | None:
        _gen, pids = current_world(a)
        return pids if len(pids) == size and not pids & without else None

    found: set[int] = job.wait_for(ready, f"a world of {size} without {sorted(without)}")
    return found


def steady_weights(root: Path, endpoint: str, steps: int) -> dict[str, torch.Tensor]:
    """The final weights of an undisturbed run: 1 node, 1 worker."""
    import uuid

    from tests.integration.launcher_scripts.harness import cluster

    with cluster(root, endpoint, f"steady-{uuid.uuid4().hex[:8]}") as c:
        job = ShardedJob(c, root, flags("1", 1), steps=steps)
        agent = job.start_node()
        job.wait_done([agent])
        return job.final_weights()


def check_outcome(outcome: Outcome, steady: dict[str, torch.Tensor], name: str) -> list[int]:
    """The checks every scenario shares; returns the steps each change rolled back."""
    from tests.integration.training.inplace_audit import check_exactly_once

    audit = outcome.audit
    assert outcome.weights.keys() == steady.keys()
    worst = max((outcome.weights[k] - steady[k]).abs().max().item() for k in steady)
    changes = lost_steps(audit)
    print(f"\n[{name}] steps lost per change (generation, world, steps): {changes}; final "
          f"weights differ from the undisturbed run's by {worst:.3g}")
    assert worst < 1e-9, f"final weights differ by {worst}"
    check_exactly_once(audit, steps=outcome.job.steps, global_batch=GLOBAL_BATCH,
                       dataset=DATASET, seed=SEED)
    by_gen = audit.pids_by_gen()
    for pid in outcome.kept_pids:
        assert all(pid in pids for pids in by_gen.values()), f"worker {pid} missed a world"
    return [lost for _, _, lost in changes]


def no_recovery_read_storage(audit: Audit) -> None:
    """The first world's workers read storage once, to start (there was no checkpoint);
    every later worker got its state from the others, and none read storage again."""
    loads: dict[int, list[int]] = {}
    for g in audit.gens:
        loads.setdefault(int(g["pid"]), []).append(int(g["storage_loads"]))
    first = min(int(g["gen"]) for g in audit.gens)
    founders = {int(g["pid"]) for g in audit.gens if int(g["gen"]) == first}
    for pid, counts in loads.items():
        assert counts == [1 if pid in founders else 0] * len(counts), (pid, counts)
    for pid in set(loads) - founders:
        first_gen = next(g for g in audit.gens if int(g["pid"]) == pid)
        assert first_gen["received"], f"newcomer {pid} trained without receiving state"
    assert len(loads) > len(founders), "no worker joined"
