"""The framework scenario's gate across a fault (``scenario.py``), driven through the Lightning
job's own gate code (``lightning_job.Audit``) by worlds that train as fast as a warm worker
(no framework run, no etcd: seconds).

The world after a fault resumes from the newest committed checkpoint, which can be steps
behind the gate the last world was held at; it must be held at its resume step, or it trains
past the count the scenario's next ``run_to`` asks for and that hold never comes (the
Lightning scenario's node-kill world, started in a warm standby, did so whenever the drain
happened at a step 4 past a multiple of the checkpoint interval).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from tests.integration.frameworks import scenario
from tests.integration.launcher_scripts.harness import wait_until
from tests.support.frameworks import framework


class FastWorld:
    """One rank training a step per gate check, in a thread, audited by the job's callback."""

    def __init__(self, job: ModuleType, audit: Path, gate: Path, resumed: int) -> None:
        self._stop = threading.Event()
        self._trainer = SimpleNamespace(global_step=resumed, global_rank=0, world_size=1,
                                        accumulate_grad_batches=1)
        self._model = SimpleNamespace(ids=[])
        self._audit = job.Audit(str(audit), self._model, str(gate), self._stop.is_set)
        self._audit.on_train_start(self._trainer, None)  # the "resumed" line
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()

    def _train(self) -> None:
        trainer = self._trainer
        while trainer.global_step < scenario.STEPS:
            self._audit.on_train_batch_start(trainer, None, None, 0)  # held at the gate
            if self._stop.is_set():
                return
            self._model.ids = [trainer.global_step]
            trainer.global_step += 1
            self._audit.on_train_batch_end(trainer, None, None, None, 0)

    def kill(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


def test_the_world_after_a_fault_is_held_where_it_resumed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    framework("lightning")
    from tests.integration.frameworks import lightning_job as job
    monkeypatch.setattr(scenario, "WAIT_S", 10.0)  # a hold that went by fails in seconds
    run = scenario.Scenario(Path(job.__file__), tmp_path, "unused", [])
    # No agent writes a job log here: the gate alone is under test.
    monkeypatch.setattr(run, "steps_logged", lambda _count: True)
    cluster: object = SimpleNamespace(all_exited=lambda: False, logs=lambda: "")
    run.open_gate(0)
    monkeypatch.setenv("ELASTIC_ROUND", "1")
    before = FastWorld(job, run.audit, run.gate, resumed=0)
    held = run.world_of(cluster, 1)  # type: ignore[arg-type]
    run.run_to(cluster, held, 18)  # type: ignore[arg-type]
    after: list[FastWorld] = []

    def kill_and_resume_from_15() -> None:
        before.kill()
        monkeypatch.setenv("ELASTIC_ROUND", "2")
        after.append(FastWorld(job, run.audit, run.gate, resumed=15))
        # It trains as far as the gate lets it before the scenario sees it resume.
        wait_until(lambda: 2 in (rounds := scenario.read_rounds(run.audit))
                   and bool(rounds[2].held), 10, "the next world to reach the gate")

    try:
        alone = run.fault_then_world(cluster, kill_and_resume_from_15, 1,  # type: ignore[arg-type]
                                     after=held.round)
        assert (alone.round, alone.resumed) == (2, 15)
        run.run_to(cluster, alone, 17)  # type: ignore[arg-type]
        assert sorted(scenario.read_rounds(run.audit)[2].steps) == [15, 16]
    finally:
        for world in after:
            world.kill()


def test_final_committed_sees_only_a_final_checkpoint(tmp_path: Path) -> None:
    run = scenario.Scenario(Path("job.py"), tmp_path, "unused", [])
    markers = run.ckpt / ".elastic-commits"
    markers.mkdir(parents=True)
    (markers / "10.json").write_text(json.dumps({"step": 10, "meta": {"final": False}}))
    assert not run.final_committed()
    (markers / "14.json").write_text(json.dumps({"step": 14, "meta": {"final": True}}))
    assert run.final_committed()
