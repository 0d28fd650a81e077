"""The loop's side of saves that do not stall training, and of the NCCL device gate, in one
CPU process with a real CheckpointManager: a save due while the previous one is still written
is deferred (never waited for) and taken once the write is done; the staging buffers exist
before the first save; and a rewind to a step the device skipped resumes training so that it
ends with the weights of an undisturbed run."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from checkpointing import CheckpointManager
from elastic import env
from elastic.errors import ConfigError
from elastic.eventlog import read_events
from elastic.loop import ElasticLoop

WRITE_HELD_S = 60.0  # the longest a held write waits for the test (a bound, never reached)


def _explicit_loop(manager: CheckpointManager, model: nn.Module, **kwargs: Any) -> ElasticLoop:
    return ElasticLoop(None, state={"model": model}, checkpoint=manager, sampler=None,
                       global_batch_size=4, install_signal_handler=False, **kwargs)


def test_a_save_due_while_the_previous_one_is_written_is_deferred_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(env.EVENTS_DIR, str(tmp_path / "events"))
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=10)
    written = threading.Event()  # the test lets the first write finish
    original = manager._persist_and_commit
    calls: list[int] = []

    def slow_first_write(step: int, *args: Any) -> Any:
        calls.append(step)
        if len(calls) == 1:
            assert written.wait(WRITE_HELD_S), "the test never let the first write finish"
        return original(step, *args)

    monkeypatch.setattr(manager, "_persist_and_commit", slow_first_write)
    busy_at_save: list[tuple[int, str | None]] = []
    save = manager.save

    def save_and_note(step: int, state: Any, **kwargs: Any) -> Any:
        busy_at_save.append((step, manager.busy()))  # would this call wait for a write?
        return save(step, state, **kwargs)

    monkeypatch.setattr(manager, "save", save_and_note)
    model = nn.Linear(3, 1, bias=False)
    expected: dict[int, torch.Tensor] = {}
    loop = _explicit_loop(manager, model, max_steps=14, checkpoint_interval=4,
                          save_backpressure="defer")
    with loop:
        for step in loop:
            with torch.no_grad():
                model.weight.add_(1.0)
            while step == 3 and manager.busy():  # the buffers, reserved after step 0
                time.sleep(0.01)
            if step == 9:  # the write of step 4 may finish now
                written.set()
            if step >= 9:  # from here on steps last longer than a write
                manager.wait()
            loop.end_step()
            expected[loop.step] = model.weight.detach().clone()
    # Step 8 fell due while step 4 was written: deferred, then taken at the first boundary
    # after that write (step 10), not at the next interval.
    assert [step for step, _ in busy_at_save] == [4, 10, 12, 14]
    assert [busy for _, busy in busy_at_save[:-1]] == [None, None, None]  # never waited
    log = [e for e in read_events(tmp_path / "events")]
    deferred = [(e["step"], e["reason"]) for e in log if e["event"] == "checkpoint_deferred"]
    assert deferred == [(8, "the save of step 4 is still being written")]
    assert not [e for e in log if e["event"] == "checkpoint" and e.get("wait") == "commit"]
    reloaded = {"model": nn.Linear(3, 1, bias=False)}
    with CheckpointManager(str(tmp_path / "ckpt")) as reader:
        reader.load(reloaded, step=10)
    assert torch.equal(reloaded["model"].weight, expected[10])


def test_backpressure_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^save_backpressure \('drop'\) must be 'wait'"):
        ElasticLoop(None, state={}, checkpoint=None, sampler=None, max_steps=1,
                    global_batch_size=4, save_backpressure="drop")
    with pytest.raises(ConfigError, match=r"^max_commit_lag \(1\) bounds lost work by waiting"):
        ElasticLoop(None, state={}, checkpoint=None, sampler=None, max_steps=1,
                    global_batch_size=4, save_backpressure="defer", max_commit_lag=1)


def test_the_staging_buffers_exist_before_the_first_save_is_due(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    from checkpointing import ModelOptimizerState

    with CheckpointManager(str(tmp_path), async_mode="disabled") as manager:
        loop = ElasticLoop(None, state={"train": ModelOptimizerState(model, optimizer)},
                           checkpoint=manager, sampler=None, max_steps=4, global_batch_size=4,
                           checkpoint_interval=3, install_signal_handler=False)
        reserved: dict[Any, torch.Tensor] = {}
        with loop:
            for step in loop:
                model(torch.ones(1, 3)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 1:  # step 0 made the optimizer's state; no save yet
                    manager._stager.join_reserve()
                    reserved = dict(manager._stager._buffers)
                loop.end_step()
            staged = dict(manager._stager._buffers)
    names = {key[0] for key in reserved}
    assert {"train.model.weight", "train.optim.state.weight.exp_avg",
            "train.optim.state.weight.exp_avg_sq"} <= names
    assert all(staged[key] is buffer for key, buffer in reserved.items())  # filled, not new


# ------------------------------------------------------------------- the device gate's rewind


def _managed(tmp: Path | None = None) -> tuple[ElasticLoop, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 4, generator=generator),
                         torch.randn(48, 1, generator=generator))
    loop = ElasticLoop(None, model=model, optimizer=optimizer, data=data, scheduler=scheduler,
                       global_batch_size=8, max_steps=10, install_signal_handler=False)
    return loop, model, optimizer


def _train(loop: ElasticLoop, model: nn.Module, *, stop_at: int | None = None) -> None:
    for x, y in loop.batches():
        if loop.step == stop_at:
            return
        loop.backward(nn.functional.mse_loss(loop.model(x), y))


def test_a_rewind_to_the_first_skipped_step_ends_with_the_weights_of_an_undisturbed_run(
) -> None:
    steady, steady_model, _ = _managed()
    _train(steady, steady_model)
    loop, model, optimizer = _managed()
    assert loop.step_gate_blocker() is None
    point = None
    device: Any = None
    for x, y in loop.batches():
        if loop.step == 3 and point is None:
            # What the gate keeps before step 3's optimizer step; the device state the
            # skipped steps 3 to 5 leave behind is the one before step 3.
            point = loop.host_step()
            device = (copy.deepcopy(model.state_dict()),
                      {id(p): {k: v.clone() for k, v in optimizer.state[p].items()}
                       for p in model.parameters()})
        if loop.step == 6:
            break  # an abort: the host had closed steps 3 to 5, the device skipped them
        loop.backward(nn.functional.mse_loss(loop.model(x), y))
    assert point is not None and loop.step == 6
    assert optimizer.param_groups[0]["lr"] != point.groups[0]["lr"]  # the scheduler ran ahead
    with torch.no_grad():
        model.load_state_dict(device[0])
        for p in model.parameters():
            for key, value in device[1][id(p)].items():
                optimizer.state[p][key].copy_(value)
    loop.rewind(point)
    assert loop.step == 3
    _train(loop, model)
    assert loop.step == 10
    for mine, theirs in zip(model.parameters(), steady_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_only_the_managed_loop_with_a_fused_optimizer_can_be_gated_on_the_device() -> None:
    model = nn.Linear(2, 1)
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1))
    plain = ElasticLoop(None, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                        data=data, global_batch_size=4, max_steps=1,
                        install_signal_handler=False)
    assert plain.step_gate_blocker() == ("AdamW cannot skip a step on the device; construct "
                                         "it with fused=True")
    extra = ElasticLoop(None, model=model,
                        optimizer=torch.optim.AdamW(model.parameters(), fused=True), data=data,
                        global_batch_size=4, max_steps=1, install_signal_handler=False,
                        state={"ema": torch.zeros(1)})
    assert extra.step_gate_blocker() == ("the state entries ['ema'] may change on the host "
                                         "and cannot be rewound")
    explicit = ElasticLoop(None, state={}, checkpoint=None, sampler=None, max_steps=1,
                           global_batch_size=4)
    assert explicit.step_gate_blocker() is not None
