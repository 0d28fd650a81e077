"""The stager keeps one host buffer per tensor across saves, DTensor local shards included."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from checkpointing import CheckpointManager
from checkpointing.staging import HostStager


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_staged_into_the_same_buffer_every_save(world_of_one: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    weight = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    stager = HostStager()
    first = stager.stage({"w": weight, "plain": torch.ones(2)})["w"]
    with torch.no_grad():
        weight.to_local().add_(1)
    second = stager.stage({"w": weight, "plain": torch.ones(2)})["w"]
    assert isinstance(first, DTensor) and isinstance(second, DTensor)
    # One kept buffer, overwritten by the second save.
    assert second.to_local().data_ptr() == first.to_local().data_ptr()
    assert torch.equal(first.to_local(), second.to_local())
    assert second.to_local().data_ptr() != weight.to_local().data_ptr()  # a copy, not a view
    assert torch.equal(second.to_local(), torch.arange(12.0).reshape(4, 3) + 1)
    assert second.placements == weight.placements and second.device_mesh == weight.device_mesh
    assert second.shape == weight.shape and stager.staged_bytes == 12 * 4 + 2 * 4


def test_a_dtensor_checkpoint_restores_bit_identically_with_reused_buffers(
    world_of_one: None, tmp_path: Path,
) -> None:
    mesh = init_device_mesh("cpu", (1,))
    weight = distribute_tensor(torch.randn(6, 5, dtype=torch.float64), mesh, [Shard(0)])
    with CheckpointManager(str(tmp_path), keep_last=3) as mgr:
        mgr.save(1, {"w": weight}).committed.result(60)
        buffers = dict(mgr._stager._buffers)
        assert list(buffers) == [("w", (6, 5), torch.float64)]  # the local shard's buffer
        with torch.no_grad():
            weight.to_local().mul_(3)
        expected = weight.to_local().clone()
        handle = mgr.save(2, {"w": weight})
        handle.staged.result(10)
        with torch.no_grad():
            weight.to_local().add_(100)  # after staging: must not reach step 2
        handle.committed.result(60)
        assert list(mgr._stager._buffers) == list(buffers)
        assert all(mgr._stager._buffers[k] is buffers[k] for k in buffers)
        target = distribute_tensor(torch.zeros(6, 5, dtype=torch.float64), mesh, [Shard(0)])
        mgr.load({"w": target}, step=2)
    assert torch.equal(target.to_local(), expected)
