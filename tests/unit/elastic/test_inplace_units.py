"""Unit tests of the in-place pieces that need no etcd: admission, failure classification and
CheckpointManager.rebind across worlds (the heal has its own, test_inplace_heal.py)."""

from __future__ import annotations

import torch.distributed as dist

from checkpointing import CheckpointManager
from elastic.inplace.controller import admissible, is_peer_failure


def test_admissible_keeps_the_oldest_members_that_divide_the_global_batch() -> None:
    live = ("a", "b", "c", "d", "e")
    assert admissible(live, 12) == ("a", "b", "c", "d")
    assert admissible(live, 10) == live
    assert admissible(live, 7) == ("a",)
    assert admissible(live, None) == live


def test_gloo_peer_errors_are_peer_failures_and_user_errors_are_not() -> None:
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert is_peer_failure(gloo)
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("connection reset"))


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
