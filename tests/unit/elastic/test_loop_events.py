"""ElasticLoop writes the step, checkpoint and restore events the goodput report reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from elastic import env
from elastic.eventlog import read_events
from tests.unit.elastic.test_loop import Job, data


def _run(job: Job, steps: int) -> None:
    with job.loop(steps) as loop:
        loader = DataLoader(data(), batch_size=loop.micro_batch_size, sampler=job.sampler)
        for _ in loop:
            for x, y, _index in loop.micro_batches(loader, job.model):
                loop.scale_loss(((job.model(x) - y) ** 2).mean()).backward()
            job.optimizer.step()
            job.optimizer.zero_grad()
            loop.end_step()


def test_the_loop_logs_steps_saves_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events"
    monkeypatch.setenv(env.EVENTS_DIR, str(events))
    monkeypatch.setenv(env.RUN_ID, "exp-9")
    _run(Job(tmp_path / "ckpt"), 5)
    _run(Job(tmp_path / "ckpt"), 7)  # resumes from step 5
    log = sorted(read_events(events), key=lambda e: e["time"])
    steps = [e["step"] for e in log if e["event"] == "step"]
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    assert all(e.get("duration_s", 0) >= 0 and e["job"] == "exp-9" for e in log)
    restored = [(e["step"], e["found"], e["read_from"]) for e in log
                if e["event"] == "restored"]
    assert restored == [(0, False, "storage"), (5, True, "storage")]  # no memory store here
    saves = [(e["step"], e["final"]) for e in log if e["event"] == "checkpoint"]
    assert saves == [(3, False), (5, True), (6, False), (7, True)]
    blocked = {e["step"]: e["blocked_s"] for e in log
               if e["event"] == "checkpoint" and not e["final"]}
    stalls = [e for e in log if e["event"] == "checkpoint_staged"]
    assert [e["step"] for e in stalls] == [3, 6]  # the final saves end the run: not staged
    for e in stalls:  # on the CPU the copy is made in the call: the stall is the call
        assert e["bytes"] > 0 and e["held_s"] == 0 and e["copy_s"] == e["stage_s"]
        assert e["stall_s"] <= blocked[e["step"]]


def test_without_an_events_dir_the_loop_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env.EVENTS_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    _run(Job(tmp_path / "ckpt"), 2)
    assert not list(tmp_path.glob("**/*.jsonl"))
