"""Jobs of ``examples/train.py`` as shipped, under real ``elastic-run`` agents with default flags.

Only script arguments and node counts vary: ``--dtype float64`` (so that two runs can be
compared to 1e-9), the number of steps and a per-step sleep (``--step-time``, so that faults
land mid-training). The per-sample audit of the managed loop (``ELASTIC_SAMPLE_AUDIT``, a
test instrument, not a flag) records which samples every rank trained in which world.

The reference is an undisturbed one-node run of the same script and arguments (no sleep),
run once per session for each number of steps (:func:`reference_weights`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState
from elastic.loop.audit import AUDIT_ENV
from membership.etcd import EtcdClient, EtcdConfig
from membership.status import read_job_status
from tests.integration.launcher_scripts.harness import REPO, Agent, Cluster, cluster, wait_until
from tests.integration.training.inplace_audit import Audit, check_exactly_once, read_audit

EXAMPLE = REPO / "examples" / "train.py"
GLOBAL_BATCH, DATASET, SEED = 64, 8192, 1234  # examples/train.py's defaults
WAIT_S = 300.0  # a hang guard (a busy 2-core host is slow), never a timing claim

_references: dict[tuple[int, tuple[str, ...]], dict[str, torch.Tensor]] = {}


def script_args(ckpt: str, steps: int, step_time: float = 0.0,
                extra: Sequence[str] = ()) -> list[str]:
    """``examples/train.py``'s command line: its defaults, in float64."""
    return [str(EXAMPLE), "--dtype", "float64", "--steps", str(steps), "--step-time",
            str(step_time), "--checkpoint-dir", ckpt, *extra]


class ExampleJob:
    """One job of ``examples/train.py`` on ``min_nodes..max_nodes`` agents of ``c``.

    Args:
        c: The cluster (real etcd) the agents run in.
        root: The job's directory (checkpoints, audit).
        steps: ``--steps`` of the script.
        min_nodes: ``--min-nodes``.
        max_nodes: ``--max-nodes``.
        etcd: How the test reads the job's state (default: the cluster's plain endpoint).
    """

    def __init__(self, c: Cluster, root: Path, *, steps: int, min_nodes: int,
                 max_nodes: int, etcd: EtcdConfig | None = None) -> None:
        self.cluster, self.root, self.steps = c, root, steps
        self.etcd = etcd or EtcdConfig(endpoints=(c.endpoint,))
        self.nodes = (min_nodes, max_nodes)
        self.ckpt = root / "ckpt"
        self.audit_dir = root / "audit"
        root.mkdir(parents=True, exist_ok=True)
        c.env[AUDIT_ENV] = str(self.audit_dir)
        # Defaults are elastic-run's, never a developer shell's.
        for name in list(c.env):
            if name.startswith(("ELASTIC_", "PET_")) and name != AUDIT_ENV:
                del c.env[name]

    def start_node(self, *flags: str, step_time: float = 0.0,
                   extra: Sequence[str] = ()) -> Agent:
        """Starts one more node: ``elastic-run`` with the node counts, etcd, job id and
        ``flags`` (none by default), running the example."""
        c = self.cluster
        return c.start(
            ["--min-nodes", str(self.nodes[0]), "--max-nodes", str(self.nodes[1]),
             "--etcd", c.endpoint, "--job-id", c.job_id, *flags],
            script_args(str(self.ckpt), self.steps, step_time, extra),
        )

    def audit(self) -> Audit:
        return read_audit(self.audit_dir) if self.audit_dir.exists() else Audit([], [], [], [])

    def wait_for(self, pred: Callable[[Audit], Any], what: str,
                 timeout: float = WAIT_S) -> Any:
        """Waits until ``pred(audit)`` is truthy and returns it; fails with the logs if every
        agent exited first or after ``timeout``."""
        found: list[Any] = []

        def check() -> bool:
            hit = pred(self.audit())
            if hit:
                found[:] = [hit]
            return bool(hit)

        try:
            wait_until(check, timeout, what, give_up=self.cluster.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.cluster.logs()}") from None
        return found[0]

    def trained_in(self, pred: Callable[[int, set[int]], bool], what: str,
                   after_gen: int = -1, timeout: float = WAIT_S) -> int:
        """The first generation after ``after_gen`` whose world size and worker pids satisfy
        ``pred`` and in which a step was completed (waits for it)."""
        def hit(audit: Audit) -> int | None:
            done = {int(d["gen"]) for d in audit.done}
            for gen, pids in sorted(audit.pids_by_gen().items()):
                if gen > after_gen and gen in done and pred(audit.world_of(gen), pids):
                    return gen
            return None

        return int(self.wait_for(hit, what, timeout))

    def world(self) -> tuple[int, str]:
        """The current world's size and mode (``inplace`` or ``restart``), from etcd."""
        client = EtcdClient(self.etcd)
        try:
            status = read_job_status(client, self.cluster.job_id)
        finally:
            client.close()
        return (status.world_size, status.mode) if status is not None else (0, "restart")

    def wait_in_place(self, size: int) -> None:
        """Waits until the job trains in place in a world of ``size`` (every worker entered
        its ``ElasticLoop``: until then a world restarts on a change), and two more steps
        (every agent and worker has heard of it)."""
        try:
            wait_until(lambda: self.world() == (size, "inplace"), WAIT_S,
                       f"the job to run in place in a world of {size}",
                       give_up=self.cluster.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.cluster.logs()}") from None
        reached = self.steps_done()
        self.wait_for(lambda _a: self.steps_done() >= reached + 2, "two steps in place")

    def steps_done(self) -> int:
        """The highest step any rank completed, plus one."""
        return max((int(d["step"]) for d in self.audit().done), default=-1) + 1

    def check_audit(self) -> Audit:
        """Every step of the job trained its global batch exactly once."""
        audit = self.audit()
        check_exactly_once(audit, steps=self.steps, global_batch=GLOBAL_BATCH,
                           dataset=DATASET, seed=SEED)
        return audit

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights of the job's final checkpoint (its last step)."""
        return checkpoint_weights(self.ckpt, self.steps)

    def wait_all(self, agents: Sequence[Agent], timeout: float = WAIT_S) -> list[int]:
        """Exit codes of ``agents`` once they all exited."""
        deadline = time.monotonic() + timeout
        return [a.wait(max(1.0, deadline - time.monotonic())) for a in agents]


def checkpoint_weights(ckpt: Path, step: int) -> dict[str, torch.Tensor]:
    """The example's model weights from its checkpoint of ``step``."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    state = ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    info = CheckpointManager(str(ckpt), async_mode="disabled").load({"train": state},
                                                                    step=step)
    assert info is not None and info.step == step, f"no checkpoint of step {step} in {ckpt}"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_weights(endpoint: str, tmp: Path, steps: int,
                      extra: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """An undisturbed one-node run's final weights (run once per session and arguments)."""
    key = (steps, tuple(extra))
    if key not in _references:
        root = tmp / f"reference-{uuid.uuid4().hex[:8]}"
        root.mkdir(parents=True)
        with cluster(root, endpoint, root.name) as r:
            job = ExampleJob(r, root, steps=steps, min_nodes=1, max_nodes=1)
            r.env.pop(AUDIT_ENV)
            agent = job.start_node(extra=extra)
            assert agent.wait(300) == 0, r.logs()
            _references[key] = job.weights()
    return _references[key]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
