"""A job of ``inplace_worker.py`` under real ``elastic-run --elastic-mode inplace`` agents."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.launcher_scripts.harness import Agent, Cluster, wait_until, workers
from tests.integration.training.inplace_audit import Audit, read_audit

WORKER = Path(__file__).with_name("inplace_worker.py")
STEPS, INTERVAL, GLOBAL_BATCH, DATASET, SEED = 30, 5, 12, 100, 11
EVENT_TIMEOUT = 60.0


@dataclass
class InPlaceJob:
    cluster: Cluster
    root: Path
    flags: tuple[str, ...]
    steps: int = STEPS
    #: ``--elastic-mode`` of the agents (``None``: elastic-run's default, ``auto``, which runs
    #: this worker in place because it calls ``elastic.init(inplace=True)``).
    mode: str | None = "inplace"
    #: Extra arguments of every worker (``("--device", "cuda")``).
    worker_args: tuple[str, ...] = ()
    weights: Path = field(init=False)

    def __post_init__(self) -> None:
        self.weights = self.root / "weights.pt"
        if self.mode is None:
            # The default must come from elastic-run, not from an ELASTIC_MODE in the
            # developer's shell (agent unit tests no longer leak one: tests/unit/launch/conftest).
            self.cluster.env.pop("ELASTIC_MODE", None)
        self.audit_dir.mkdir(parents=True, exist_ok=True)

    @property
    def audit_dir(self) -> Path:
        return self.root / "audit"

    @property
    def gate(self) -> Path:
        return self.root / "gate"

    def open_gate(self, up_to: int) -> None:
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(up_to))
        os.replace(tmp, self.gate)

    def start_node(self, step_time: float = 0.0, *extra: str,
                   setup_delay: float = 0.0) -> Agent:
        args = [
            str(WORKER), "--checkpoint-dir", str(self.root / "ckpt"),
            "--audit-dir", str(self.audit_dir), "--steps", str(self.steps),
            "--interval", str(INTERVAL), "--global-batch", str(GLOBAL_BATCH),
            "--dataset-size", str(DATASET), "--step-time", str(step_time),
            "--gate-file", str(self.gate), "--weights-out", str(self.weights),
            "--setup-delay", str(setup_delay), *self.worker_args,
        ]
        mode = ("--elastic-mode", self.mode) if self.mode else ()
        return self.cluster.start_elastic(*mode, *self.flags, *extra, worker_args=args)

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

    def worker_pid(self, agent: Agent) -> int:
        pids = workers(agent)
        assert len(pids) == 1, f"agent {agent.pid} has workers {pids}"
        return pids[0]

    def current_world(self, audit: Audit) -> tuple[int, set[int]]:
        """The newest generation and the pids that logged it."""
        by_gen = audit.pids_by_gen()
        if not by_gen:
            return -1, set()
        gen = max(by_gen)
        return gen, by_gen[gen]
