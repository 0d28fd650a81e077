"""The NCCL step fence's device gate (``ELASTIC_NCCL_STEP_FENCE=device``) on a simulated device
(tests/support/streams.py: queued work runs when the stream advances, in order), with a real
WorldAbort: the host never waits, a step whose collective an abort cut short is skipped on the
device, the loop rewinds its host state to the first skipped step, and a world's late abort
never reaches the next world's steps. tests/gpu and benchmarks/gpu_training.py run it on CUDA.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch

from elastic.inplace import step_fence
from elastic.inplace.abort import WorldAbort, WorldAbortedError
from elastic.inplace.controller import InPlaceController
from elastic.inplace.heal import HealResult
from elastic.inplace.step_fence import FenceMode, StepFence
from elastic_errors import ConfigError
from tests.support.streams import SimEvent, StreamSim

CUDA1 = torch.device("cuda", 1)  # never touched: only handed to the stand-ins


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    # A simulated stream that cannot drain is a failed test, not a 60 s wait.
    monkeypatch.setattr(step_fence, "SETTLE_TIMEOUT_S", 2.0)


class _FusedSGD:
    """A fused optimizer as the device runs it: its update is queued on the stream and, like
    torch's fused kernels, does nothing when ``found_inf`` holds 1 when it runs."""

    _step_supports_amp_scaling = True

    def __init__(self, sim: StreamSim, weight: torch.Tensor) -> None:
        self.sim, self.weight = sim, weight
        self.param_groups = [{"params": [weight], "lr": 1.0}]
        self.grad = torch.zeros_like(weight)

    def step(self) -> None:
        found = getattr(self, "found_inf", None)
        lr = self.param_groups[0]["lr"]

        def update() -> None:
            if found is None or float(found) != 1.0:
                self.weight.sub_(lr * self.grad)

        self.sim.main.enqueue(update)


class _Rig:
    """A device-gate fence on the simulator, a real WorldAbort wired as the controller wires
    it, and a one-parameter model whose gradient comes from a simulated all-reduce."""

    def __init__(self, epoch: int = 1) -> None:
        self.sim = StreamSim()
        self.fence = StepFence(
            CUDA1, mode=FenceMode.DEVICE, current_stream=lambda _d: self.sim.main,
            new_event=lambda: SimEvent(self.sim),
            gate_tensors=lambda _d: (torch.zeros(()), torch.zeros(step_fence._SLOTS)),
            queue_copy=lambda slot, flag: self.sim.main.enqueue(lambda: slot.copy_(flag)))
        self.weight = torch.zeros(1)
        self.optimizer = _FusedSGD(self.sim, self.weight)
        self.host_step = 0  # the loop's host state: its step counter
        self.new_world(epoch)

    def new_world(self, epoch: int) -> None:
        self.guard = WorldAbort(name=f"e{epoch}", on_abort=self.fence.on_abort)
        self.guard.built()

    def step(self, *, peers: SimEvent | None = None) -> None:
        """Queues one step: the gradient all-reduce (waiting for ``peers`` if given, else
        done at once), then the gated optimizer update; the host then closes the step."""
        if peers is not None:
            self.sim.main.wait_event(peers)  # the collective: released by the peers or an abort
        self.sim.main.enqueue(lambda: self.optimizer.grad.fill_(1.0))
        self.fence.before_optimizer_step(self.guard, self.optimizer,
                                         snapshot=lambda: self.host_step)
        self.optimizer.step()
        self.fence.after_optimizer_step(self.optimizer)
        self.host_step += 1

    def settle(self, guard: WorldAbort | None = None) -> None:
        """Drops the world (the device runs on while the host polls, as a real one does)."""
        self.sim.runs_when_polled = True
        try:
            self.fence.settle(guard or self.guard)
        finally:
            self.sim.runs_when_polled = False

    def hung_collective(self) -> SimEvent:
        peers = SimEvent(self.sim)
        peers.done = False  # completes when the test says (a peer answers, or an abort)
        return peers


def test_the_host_never_waits_and_sound_steps_are_confirmed_without_a_wait() -> None:
    rig = _Rig()
    for _ in range(3):
        rig.step()
    assert rig.sim.main.syncs == 0 and float(rig.weight) == 0  # nothing ran yet
    assert not hasattr(rig.optimizer, "found_inf")  # given back after each step
    rig.sim.run_all()
    assert float(rig.weight) == -3.0  # every step applied: the gates read 0
    rig.step()  # listing a step confirms the finished ones (their events, flag clear)
    assert len(rig.fence._pending) == 1
    rig.sim.run_all()
    rig.settle()  # a planned change: nothing to rewind
    assert rig.fence.rewind_point() is None and not rig.fence.spoiled


def test_steps_behind_a_collective_an_abort_cut_short_are_skipped_and_rewound() -> None:
    rig = _Rig()
    rig.step()  # step 0: its collective completes
    peers = rig.hung_collective()
    rig.step(peers=peers)  # step 1: its collective hangs on a lost peer
    rig.step()  # step 2: queued behind it (the host ran ahead)
    rig.sim.run_all()
    assert float(rig.weight) == -1.0 and rig.host_step == 3
    rig.guard.abort("member b/0.1 is gone")  # writes the flag, then aborts the communicators
    peers.done = True  # the abort released the collective: its output is garbage
    with pytest.raises(WorldAbortedError):
        rig.step()  # the host learns of the abort at its next step at the latest
    rig.settle()  # dropping the world: the stream is waited for
    assert float(rig.weight) == -1.0  # steps 1 and 2 were skipped on the device
    assert rig.fence.rewind_point() == 1  # the loop resumes at step 1, not 3
    assert rig.fence.rewind_point() is None and not rig.fence.spoiled


def test_a_step_whose_collective_finished_before_the_abort_is_kept() -> None:
    rig = _Rig()
    peers = rig.hung_collective()
    rig.step(peers=peers)
    peers.done = True  # the peers answered
    rig.sim.run_all()  # and the step's gate ran before the abort
    hung = rig.hung_collective()
    rig.step(peers=hung)
    rig.guard.abort("gone")
    hung.done = True  # released by the abort
    rig.settle()
    assert float(rig.weight) == -1.0
    assert rig.fence.rewind_point() == 1


def test_an_abort_before_the_worlds_first_gate_still_skips_it() -> None:
    rig = _Rig()
    peers = rig.hung_collective()
    rig.sim.main.wait_event(peers)
    with mock.patch.object(rig.guard, "check"):  # the abort lands right after the host check
        rig.guard.abort("gone")  # no gate exists yet: nothing to write
        rig.step()
    peers.done = True
    rig.settle()
    assert float(rig.weight) == 0.0 and rig.fence.rewind_point() == 0


def test_a_late_abort_of_a_dropped_world_never_reaches_the_next_worlds_steps() -> None:
    rig = _Rig()
    rig.step()
    old = rig.guard
    rig.settle(old)  # a planned change: released, then settled
    rig.new_world(2)
    rig.step()
    old.abort("late")  # after the release: only sets the old world's flag
    rig.sim.run_all()
    assert float(rig.weight) == -2.0
    rig.settle()
    assert rig.fence.rewind_point() is None


def test_a_stream_that_does_not_finish_leaves_the_state_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(step_fence, "SETTLE_TIMEOUT_S", 0.05)
    rig = _Rig()
    rig.step(peers=rig.hung_collective())  # never released
    rig.guard.abort("gone")
    rig.settle()
    assert rig.fence.spoiled and rig.fence.rewind_point() is None
    rig.fence.replaced()
    assert not rig.fence.spoiled


def test_a_grad_scalers_found_inf_is_kept_and_given_back() -> None:
    rig = _Rig()
    own = torch.tensor(1.0)  # GradScaler found an inf: the step must be skipped anyway
    rig.optimizer.found_inf = own  # type: ignore[attr-defined]
    rig.step()
    assert rig.optimizer.found_inf is own  # type: ignore[attr-defined]
    rig.sim.run_all()
    assert float(rig.weight) == 0.0


def test_an_optimizer_that_cannot_skip_on_the_device_makes_the_host_wait() -> None:
    rig = _Rig()
    plain = mock.Mock(spec=["step", "param_groups"])
    rig.fence.before_optimizer_step(rig.guard, plain, snapshot=lambda: 0)
    assert rig.sim.main.syncs == 1 and not hasattr(plain, "found_inf")


def test_a_save_in_device_mode_is_checked_once_its_copy_is_complete() -> None:
    rig = _Rig()
    check = rig.fence.before_save(rig.guard)
    assert check is not None and rig.sim.main.syncs == 0
    check()
    rig.guard.abort("gone")
    with pytest.raises(WorldAbortedError):
        check()


def test_a_real_fused_adamw_skips_its_whole_update_on_the_gate() -> None:
    # torch's fused AdamW (on the CPU here; the CUDA kernel honours found_inf the same way):
    # the seam the device gate stands on.
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    fence = StepFence(torch.device("cpu"), mode=FenceMode.DEVICE,
                      current_stream=lambda _d: mock.Mock(),
                      new_event=lambda: mock.Mock(query=mock.Mock(return_value=False)))
    guard = WorldAbort(name="e1", on_abort=fence.on_abort)
    guard.built()
    optimizer.register_step_pre_hook(
        lambda o, *_a: fence.before_optimizer_step(guard, o, snapshot=lambda: None))
    optimizer.register_step_post_hook(lambda o, *_a: fence.after_optimizer_step(o))
    weight.grad = torch.ones(8)
    optimizer.step()  # the gate reads 0: applied
    applied = weight.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[weight].items()}
    assert float(state["step"]) == 1.0
    with mock.patch.object(guard, "check"):  # the abort comes after the host's check
        guard.abort("gone")
        optimizer.step()  # the CPU "device" copies the flag at once: it reads 1
    assert torch.equal(weight.detach(), applied)
    assert all(torch.equal(optimizer.state[weight][k], v) for k, v in state.items())
    assert not hasattr(optimizer, "found_inf")


# ------------------------------------------------------------------------- configuration


def test_auto_gates_on_the_device_only_where_the_loop_allows_it() -> None:
    fence = StepFence(CUDA1, mode=FenceMode.AUTO)
    assert fence.wait  # until resolved: the host wait
    fence.configure(None)
    assert fence.mode is FenceMode.DEVICE and not fence.wait
    fence.configure("the explicit way")  # a second loop in the same process
    assert fence.mode is FenceMode.WAIT
    with pytest.raises(ConfigError, match=r"^ELASTIC_NCCL_STEP_FENCE=device cannot gate this "
                       r"loop's steps on the device \(SGD cannot skip"):
        StepFence(CUDA1, mode=FenceMode.DEVICE).configure("SGD cannot skip a step")


class _Loop:
    def __init__(self) -> None:
        self.step = 7
        self.has_state = True
        self.global_batch_size = 4
        self.checkpoint = None
        self.rewound: list[Any] = []

    def heal_state(self) -> dict[str, Any]:
        return {}

    def world_changed(self) -> None:
        pass

    def restore_from_storage(self) -> int:
        raise AssertionError("a rewound survivor holds sound state")

    def settle_save(self) -> None:
        pass

    def step_gate_blocker(self) -> str | None:
        return None

    def rewind(self, point: Any) -> None:
        self.rewound.append(point)
        self.step = point


def test_the_controller_rewinds_the_loop_before_it_reports_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from datetime import timedelta

    monkeypatch.setenv(step_fence.STEP_FENCE_ENV, "auto")
    controller = InPlaceController(mock.Mock(), backend="nccl", device=CUDA1,
                                   build_timeout=timedelta(seconds=1), train_timeout=None)
    controller.ctx = mock.Mock()
    loop = _Loop()
    controller.check_config(loop)
    assert controller.fence is not None and controller.fence.mode is FenceMode.DEVICE
    controller.fence._rewind = 5  # what settle found: the device skipped steps 5 and 6
    heal = mock.Mock(return_value=HealResult(step=5, source=0, steps=(5,), received=False))
    monkeypatch.setattr("elastic.inplace.controller.agree_and_heal", heal)
    controller._heal(loop)
    assert loop.rewound == [5] and heal.call_args.args[0] == 5
