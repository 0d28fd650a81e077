"""The NCCL step fence's decisions, with stand-ins for the CUDA stream and events (no GPU
here; tests/gpu runs the real thing): when the host waits, what an abort spoils, and what
the controller then reports in the heal."""

from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import pytest
import torch

from elastic.inplace.abort import WorldAbort, WorldAbortedError
from elastic.inplace.controller import InPlaceController, SpoiledStateError
from elastic.inplace.heal import HealResult
from elastic.inplace.step_fence import (
    STEP_FENCE_ENV,
    FenceMode,
    StepFence,
    step_fence_from_env,
)
from elastic_errors import ConfigError

CUDA1 = torch.device("cuda", 1)  # never touched: only handed to the stand-ins


class _Stream:
    """A CUDA stream stand-in: counts host waits; ``on_sync`` runs inside a wait (an abort
    that releases the collective the host waits for)."""

    def __init__(self) -> None:
        self.syncs = 0
        self.on_sync: Any = None

    def synchronize(self) -> None:
        self.syncs += 1
        if self.on_sync is not None:
            self.on_sync()


class _Event:
    """A CUDA event stand-in: finished once the test says so."""

    def __init__(self, events: list[_Event]) -> None:
        self.done = False
        self.recorded_on: Any = None
        self.host_waits = 0
        self.on_record: Any = None
        events.append(self)

    def record(self, stream: Any) -> None:
        self.recorded_on = stream
        if self.on_record is not None:
            self.on_record()

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.host_waits += 1
        self.done = True


class _Rig:
    """A fence on stand-ins, and a real WorldAbort of a world with no groups, wired as the
    controller wires them (the abort calls the fence before tearing anything down)."""

    def __init__(self, *, wait: bool) -> None:
        self.stream = _Stream()
        self.events: list[_Event] = []
        self.devices: list[torch.device] = []

        def current_stream(device: torch.device) -> _Stream:
            self.devices.append(device)
            return self.stream

        self.fence = StepFence(CUDA1, mode=FenceMode.WAIT if wait else FenceMode.LATER,
                               current_stream=current_stream,
                               new_event=lambda: _Event(self.events))
        self.guard = WorldAbort(name="e7", on_abort=self.fence.on_abort)
        self.guard.built()  # nothing to sever: the test opened no socket meanwhile

    def step(self) -> None:
        self.fence.before_optimizer_step(self.guard)


def test_by_default_the_host_waits_for_the_stream_then_refuses_a_step_of_an_aborted_world(
) -> None:
    rig = _Rig(wait=True)
    rig.step()
    assert rig.stream.syncs == 1 and rig.devices == [CUDA1] and rig.events == []
    # The peer dies while the host waits: the abort releases the collective (the wait ends)
    # and the flag, set before it, refuses the step.
    rig.stream.on_sync = lambda: rig.guard.abort("member b/0.1 is gone")
    with pytest.raises(WorldAbortedError, match=r"world e7 was aborted \(member b/0.1 is gone"):
        rig.step()
    assert rig.stream.syncs == 2
    assert not rig.fence.spoiled  # nothing was ever applied on a garbage collective
    rig.fence.before_save(rig.guard)  # the steps were checked already: no wait of its own
    assert rig.stream.syncs == 2


def test_checking_later_never_waits_and_a_step_the_abort_cut_short_spoils_the_state() -> None:
    rig = _Rig(wait=False)
    rig.step()
    rig.step()
    assert rig.stream.syncs == 0  # no host wait at all
    assert [e.recorded_on for e in rig.events] == [rig.stream, rig.stream]
    assert rig.devices == [CUDA1, CUDA1]
    rig.events[0].done = True  # step 0's collective finished; step 1's is still queued
    rig.guard.abort("member b/0.1 is gone")
    assert rig.fence.spoiled  # step 1 was applied on the garbage
    with pytest.raises(WorldAbortedError):
        rig.step()  # and no further step is applied
    assert len(rig.events) == 2
    rig.fence.replaced()
    assert not rig.fence.spoiled


def test_an_abort_after_every_applied_step_finished_spoils_nothing() -> None:
    rig = _Rig(wait=False)
    for _ in range(3):
        rig.step()
    for event in rig.events:
        event.done = True
    rig.guard.abort("gone")
    assert not rig.fence.spoiled


def test_a_step_the_abort_beat_is_refused_and_spoils_nothing() -> None:
    rig = _Rig(wait=False)
    rig.step()
    rig.events[0].done = True
    # The abort lands while the step is being listed, before the fence's last check: the
    # step is refused, not applied, so its unfinished event spoils nothing.
    original = _Event.record

    def record_then_abort(event: _Event, stream: Any) -> None:
        original(event, stream)
        rig.guard.abort("gone")

    with mock.patch.object(_Event, "record", record_then_abort), \
            pytest.raises(WorldAbortedError):
        rig.step()
    assert not rig.fence.spoiled


def test_an_abort_right_after_the_last_check_spoils_the_step_it_let_through() -> None:
    rig = _Rig(wait=False)

    class LateGuard:
        """Passes its checks; the abort arrives just after the second one returned."""

        calls = 0
        aborted = False

        def check(self) -> None:
            LateGuard.calls += 1
            if LateGuard.calls == 2:
                rig.guard.abort("gone")  # notes the listed, unfinished step

    rig.fence.before_optimizer_step(LateGuard())
    assert rig.fence.spoiled


def test_an_unreadable_event_counts_as_unfinished() -> None:
    rig = _Rig(wait=False)
    rig.step()
    rig.events[0].query = mock.Mock(side_effect=RuntimeError("CUDA error"))  # type: ignore
    rig.guard.abort("gone")
    assert rig.fence.spoiled


def test_the_host_waits_for_the_oldest_step_when_far_ahead_of_the_device() -> None:
    rig = _Rig(wait=False)
    for _ in range(70):
        rig.step()
    assert rig.stream.syncs == 0
    assert sum(e.host_waits for e in rig.events) == 70 - 64
    assert rig.events[0].host_waits == 1 and rig.events[-1].host_waits == 0


def test_checking_later_waits_before_a_save_and_refuses_the_state_of_an_aborted_world() -> None:
    rig = _Rig(wait=False)
    rig.step()
    rig.fence.before_save(rig.guard)
    assert rig.stream.syncs == 1
    rig.guard.abort("gone")  # after the wait: the step was sound
    assert not rig.fence.spoiled
    with pytest.raises(WorldAbortedError):
        rig.fence.before_save(rig.guard)


def test_settling_waits_only_for_a_world_that_was_not_aborted() -> None:
    planned = _Rig(wait=False)
    planned.step()
    planned.fence.settle(planned.guard)
    assert planned.stream.syncs == 1
    planned.guard.release()
    planned.guard.abort("late")  # after the release: the fence is not consulted
    assert not planned.fence.spoiled
    failed = _Rig(wait=False)
    failed.step()
    failed.guard.abort("gone")
    failed.fence.settle(failed.guard)
    assert failed.stream.syncs == 0 and failed.fence.spoiled


def test_the_abort_thread_and_the_training_thread_agree() -> None:
    # Whatever the interleaving, a step is spoiled only if it was applied and unfinished.
    for _ in range(200):
        rig = _Rig(wait=False)
        applied = []

        def train(rig: _Rig = rig, applied: list[int] = applied) -> None:
            for i in range(20):
                try:
                    rig.step()
                except WorldAbortedError:
                    return
                applied.append(i)

        thread = threading.Thread(target=train)
        thread.start()
        rig.guard.abort("gone")
        thread.join(5)
        assert rig.fence.spoiled == bool(applied)  # no event ever finishes here


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STEP_FENCE_ENV, raising=False)
    assert step_fence_from_env() is FenceMode.AUTO
    for raw, mode in (("1", FenceMode.WAIT), ("0", FenceMode.LATER),
                      (" Device ", FenceMode.DEVICE), ("auto", FenceMode.AUTO)):
        monkeypatch.setenv(STEP_FENCE_ENV, raw)
        assert step_fence_from_env() is mode
    monkeypatch.setenv(STEP_FENCE_ENV, "off")
    with pytest.raises(ConfigError, match=r"ELASTIC_NCCL_STEP_FENCE \('off'\) must be auto"):
        step_fence_from_env()


# ------------------------------------------------------------------------- the controller


def _controller(backend: str, monkeypatch: pytest.MonkeyPatch, fence: str = "1",
                ) -> InPlaceController:
    from datetime import timedelta

    monkeypatch.setenv(STEP_FENCE_ENV, fence)
    controller = InPlaceController(mock.Mock(), backend=backend, device=CUDA1,
                                   build_timeout=timedelta(seconds=1), train_timeout=None)
    controller.ctx = mock.Mock()
    return controller


class _Loop:
    def __init__(self, checkpoint: Any) -> None:
        self.step = 9
        self.has_state = True
        self.global_batch_size = 4
        self.checkpoint = checkpoint
        self.restored = 0

    def heal_state(self) -> dict[str, Any]:
        return {}

    def world_changed(self) -> None:
        pass

    def restore_from_storage(self) -> int:
        self.restored += 1
        return self.step

    def settle_save(self) -> None:
        pass

    def step_gate_blocker(self) -> str | None:
        return "the explicit way"

    def rewind(self, point: Any) -> None:
        raise AssertionError("only the device gate rewinds")


def test_gloo_needs_no_fence_and_nccl_gets_the_configured_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _controller("gloo", monkeypatch).fence is None
    fence = _controller("nccl", monkeypatch, "0").fence
    assert fence is not None and fence.wait is False and fence.device == CUDA1
    controller = _controller("nccl", monkeypatch, "0")
    with pytest.raises(ConfigError, match=r"ELASTIC_NCCL_STEP_FENCE=0 rolls survivors back"):
        controller.check_config(_Loop(checkpoint=None))
    controller.check_config(_Loop(checkpoint=mock.Mock()))
    _controller("nccl", monkeypatch, "1").check_config(_Loop(checkpoint=None))


def test_a_spoiled_worker_reports_no_state_and_restores_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller("nccl", monkeypatch, "0")
    rig = _Rig(wait=False)
    controller.fence, controller._guard = rig.fence, rig.guard
    controller.before_optimizer_step()
    rig.guard.abort("gone")
    with pytest.raises(WorldAbortedError):
        controller.check_agreement()  # the flags read now may be garbage
    assert rig.fence.spoiled
    heal = mock.Mock(return_value=HealResult(step=-1, source=-1, steps=(-1, -1),
                                             received=False))
    monkeypatch.setattr("elastic.inplace.controller.agree_and_heal", heal)
    checkpoint = mock.Mock()
    loop = _Loop(checkpoint)
    controller._heal(loop)
    assert heal.call_args.args[0] == -1  # not its step 9: its state is garbage
    assert loop.restored == 1 and not rig.fence.spoiled
    # A worker that is not spoiled reports its step.
    controller._heal(loop)
    assert heal.call_args.args[0] == 9


def test_a_spoiled_worker_with_nothing_to_roll_back_to_stops_with_one_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller("nccl", monkeypatch, "0")
    rig = _Rig(wait=False)
    controller.fence, controller._guard = rig.fence, rig.guard
    controller.before_optimizer_step()
    rig.guard.abort("gone")
    monkeypatch.setattr("elastic.inplace.controller.agree_and_heal", mock.Mock(
        return_value=HealResult(step=-1, source=-1, steps=(-1,), received=False)))
    checkpoint = mock.Mock()
    checkpoint.latest.return_value = None
    checkpoint.storage.url = "s3://bucket/run"
    loop = _Loop(checkpoint)
    with pytest.raises(SpoiledStateError, match=r"no checkpoint is committed in "
                       r"s3://bucket/run, so training cannot go on; unset "
                       r"ELASTIC_NCCL_STEP_FENCE"):
        controller._heal(loop)
    assert loop.restored == 0


def test_by_default_the_controller_never_doubts_the_agreement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller = _controller("nccl", monkeypatch, "1")
    rig = _Rig(wait=True)
    controller.fence, controller._guard = rig.fence, rig.guard
    rig.guard.abort("gone")
    controller.check_agreement()  # flags read a step late were checked by the step's wait
    with pytest.raises(WorldAbortedError):
        controller.before_optimizer_step()
