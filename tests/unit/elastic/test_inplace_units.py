"""Unit tests of the in-place pieces that need no etcd: the failure-type rule and
CheckpointManager.rebind across worlds (the heal has its own, test_inplace_heal.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from checkpointing import CheckpointManager
from elastic.failures import is_peer_failure_type


def test_only_collective_error_types_can_be_a_peers_failure_whatever_the_message() -> None:
    # The type decides whether a failure *may* be a peer's; membership evidence decides
    # whether it *is* (InPlaceController.confirm_peer_failure). Message text decides nothing.
    assert is_peer_failure_type(RuntimeError("[gloo/pair.cc:537] Connection reset by peer"))
    assert is_peer_failure_type(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert is_peer_failure_type(dist.DistNetworkError("timed out"))
    assert not is_peer_failure_type(ValueError("connection reset by peer"))
    assert not is_peer_failure_type(torch.OutOfMemoryError("CUDA out of memory"))

    class Subclassed(RuntimeError):
        pass

    assert not is_peer_failure_type(Subclassed("a script's own RuntimeError subclass"))


def test_every_rank_of_a_world_saves_into_the_same_round_directory(tmp_path: object) -> None:
    # Managers built in different worlds (a survivor, a newcomer) must agree on the directory
    # once the loop rebinds them to the same world, or their shards part ways.
    from checkpointing.layout import format_dir_name

    survivor = CheckpointManager(str(tmp_path), round=3)
    newcomer = CheckpointManager(str(tmp_path), round=9)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        for manager in (survivor, newcomer):
            manager.rebind(group, 12)
        assert {format_dir_name(5, m.round) for m in (survivor, newcomer)} == {
            format_dir_name(5, 12)}
    finally:
        dist.destroy_process_group()
        survivor.close()
        newcomer.close()
