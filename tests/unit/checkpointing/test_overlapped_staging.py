"""Overlapped staging and staging buffers allocated ahead, on a simulated device
(tests/support/streams.py keeps CUDA's stream order; tests/gpu and benchmarks/gpu_training.py
run the real thing): the copy of a save sees the saved step's state and nothing queued after
it, the writer reads the buffers only once the copy is complete, and a save finds its buffers
allocated before it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointManager
from checkpointing.errors import CheckpointCommitError
from checkpointing.staging import HostStager
from tests.support.streams import SimDeviceApi, StreamSim


def _device_weight(sim: StreamSim) -> torch.Tensor:
    weight = torch.zeros(4)
    sim.on_device(weight)
    return weight


def test_an_overlapped_copy_sees_the_saved_step_and_not_the_next_one() -> None:
    sim = StreamSim()
    api = SimDeviceApi(sim)
    weight = _device_weight(sim)
    stager = HostStager(api)
    sim.main.enqueue(lambda: weight.add_(1))  # the saved step's update, still queued
    staged = stager.stage_async({"w": weight, "host": torch.full((2,), 7.0)}, overlap=True)
    assert staged.overlapped and not staged.done()  # the call did not wait for the device
    assert sim.main.syncs == 0 and weight.sum() == 0
    assert torch.equal(staged.host_state["host"], torch.full((2,), 7.0))  # host state: now
    staged.hold()
    sim.main.enqueue(lambda: weight.add_(100))  # the next step's update
    sim.main.run()  # the training stream runs as far as it may before the side stream
    assert torch.equal(weight, torch.ones(4))  # held before the next step's update
    sim.run_all()
    staged.wait()
    assert torch.equal(staged.host_state["w"], torch.ones(4))
    assert torch.equal(weight, torch.full((4,), 101.0))
    side = sim.streams[1]
    # The caching allocator knows that the side stream reads the source.
    assert api.record_stream_calls == [(weight.data_ptr(), side)]
    timings = staged.timings()
    assert timings is not None and timings[0] > 0 and timings[1] > 0


def test_without_the_hold_the_next_step_would_overwrite_what_is_copied() -> None:
    # What hold() prevents, shown on the same simulator: the device runs the next step's
    # update before the side stream copies.
    sim = StreamSim()
    weight = _device_weight(sim)
    staged = HostStager(SimDeviceApi(sim)).stage_async({"w": weight}, overlap=True)
    sim.main.enqueue(lambda: weight.add_(100))
    sim.main.run()
    sim.run_all()
    assert torch.equal(staged.host_state["w"], torch.full((4,), 100.0))
    assert staged.timings() is None  # never held: no stall to report


def test_a_copy_in_order_waits_for_the_stream_before_returning() -> None:
    sim = StreamSim()
    weight = _device_weight(sim)
    sim.main.enqueue(lambda: weight.add_(1))
    staged = HostStager(SimDeviceApi(sim)).stage_async({"w": weight}, overlap=False)
    assert sim.main.syncs == 1 and not staged.overlapped
    assert torch.equal(staged.host_state["w"], torch.ones(4))
    assert staged.timings() == (0.0, 0.0)


def test_the_writer_reads_the_buffers_once_the_copy_is_complete(tmp_path: Path) -> None:
    sim = StreamSim()
    weight = _device_weight(sim)
    with CheckpointManager(str(tmp_path), async_mode="disabled") as manager:
        manager._stager = HostStager(SimDeviceApi(sim))
        sim.main.enqueue(lambda: weight.add_(1))
        handle = manager.save(1, {"w": weight}, overlap=True)
        assert handle.copy is not None and handle.copy.done()  # the writer waited for it
        handle.copy.hold()
        sim.main.enqueue(lambda: weight.add_(100))
        sim.run_all()
        handle.committed.result(30)
        loaded = {"w": torch.zeros(4)}
        manager.load(loaded, step=1)
    assert torch.equal(loaded["w"], torch.ones(4))


def test_a_check_after_the_copy_can_refuse_the_save(tmp_path: Path) -> None:
    sim = StreamSim()
    weight = _device_weight(sim)
    checked: list[bool] = []

    def refuse() -> None:
        checked.append(bool(weight.sum() == 4))  # runs once the copy ran (the step's state)
        raise RuntimeError("world epoch 3 was aborted (gone).")

    with CheckpointManager(str(tmp_path), async_mode="disabled") as manager:
        manager._stager = HostStager(SimDeviceApi(sim))
        manager.save(1, {"w": weight}, overlap=True).committed.result(30)
        sim.main.enqueue(lambda: weight.add_(1))
        handle = manager.save(2, {"w": weight}, overlap=True, after_copy=refuse)
        with pytest.raises(CheckpointCommitError, match=r"world epoch 3 was aborted"):
            handle.committed.result(30)
        with pytest.raises(RuntimeError, match=r"aborted"):
            handle.staged.result(1)  # the copy is not the step's: never staged
        assert checked == [True]
        latest = manager.latest()
    assert latest is not None and latest.step == 1
    assert not any((tmp_path / name / "COMMIT.json").exists()
                   for name in (p.name for p in tmp_path.iterdir()) if "0000000002" in name)


class _SlowApi(SimDeviceApi):
    """Pinning is slow (CUDA pins about 1.8 GB/s): each buffer takes ``delay`` seconds."""

    def __init__(self, sim: StreamSim, delay: float) -> None:
        super().__init__(sim)
        self.delay = delay
        self.allocated_on: list[str] = []

    def host_buffer(self, shape: torch.Size, dtype: torch.dtype, device_source: bool
                    ) -> torch.Tensor:
        self.allocated_on.append(threading.current_thread().name)
        time.sleep(self.delay)
        return super().host_buffer(shape, dtype, device_source)


def test_buffers_reserved_in_the_background_are_the_ones_the_first_save_fills(
    tmp_path: Path,
) -> None:
    sim = StreamSim()
    api = _SlowApi(sim, delay=0.2)
    state = {"w": _device_weight(sim), "b": torch.zeros(2)}
    sim.on_device(state["b"])
    with CheckpointManager(str(tmp_path), async_mode="disabled") as manager:
        manager._stager = HostStager(api)
        assert manager.reserve(state) == 6 * 4
        assert manager.busy() == "the staging buffers are still being allocated"
        assert api.allocated_on[:1] == ["checkpoint-staging-reserve"]
        manager._stager.join_reserve()
        assert manager.busy() is None
        reserved = dict(manager._stager._buffers)
        assert sorted(k[0] for k in reserved) == ["b", "w"]
        assert manager.reserve(state) == 0  # nothing more to allocate
        handle = manager.save(1, state, overlap=True)
        sim.run_all()
        handle.committed.result(30)
        assert all(manager._stager._buffers[k] is reserved[k] for k in reserved)
        assert api.allocated_on == ["checkpoint-staging-reserve"] * 2  # none by the save


def test_a_failed_reservation_leaves_the_allocation_to_the_save(tmp_path: Path) -> None:
    sim = StreamSim()

    class Exhausted(SimDeviceApi):
        calls = 0

        def host_buffer(self, shape: torch.Size, dtype: torch.dtype, device_source: bool
                        ) -> torch.Tensor:
            Exhausted.calls += 1
            if threading.current_thread().name == "checkpoint-staging-reserve":
                raise RuntimeError("CUDA error: out of memory (pinned)")
            return super().host_buffer(shape, dtype, device_source)

    weight = _device_weight(sim)
    stager = HostStager(Exhausted(sim))
    stager.reserve({"w": weight})
    stager.join_reserve()
    staged = stager.stage_async({"w": weight}, overlap=False)
    assert torch.equal(staged.host_state["w"], torch.zeros(4)) and Exhausted.calls == 2
