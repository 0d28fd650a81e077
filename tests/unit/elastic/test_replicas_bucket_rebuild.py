"""DDP's bucket rebuild is a collective of a forward: the in-place progress rule watches it.

The first forward of a DDP's second step rebuilds its buckets (from the order the first synced
backward produced gradients in) and broadcasts the layout from rank 0. A peer hung right before
that forward used to leave the survivors waiting there without reporting it (the progress
clock started at the step's last micro-batch), until the backend's timeout (CI's netns test).
:class:`~elastic.loop.replicas.Replicas` calls its ``on_bucket_rebuild`` before that forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.loop.replicas import Replicas


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[Any]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield SimpleNamespace(generation=1, device=torch.device("cpu"),
                              process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_the_rebuild_forward_is_announced_once_before_ddp_rebuilds(one_rank: Any) -> None:
    step, calls = [0], []
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    replicas = Replicas(cast(Any, one_rank), in_place=True, step=lambda: step[0],
                        on_bucket_rebuild=lambda: calls.append(step[0]))
    ddp = replicas.wrap(model)
    rebuilt_before_call: list[bool] = []
    ddp.register_forward_pre_hook(
        lambda *_: rebuilt_before_call.append(bool(ddp._has_rebuilt_buckets)))
    x = torch.randn(3, 4)
    with ddp.no_sync():  # step 0: a micro-batch without sync, then the synced one
        ddp(x).sum().backward()
    ddp(x).sum().backward()
    assert calls == []  # no rebuild in the step the DDP was built in
    step[0] = 1
    with torch.no_grad():
        ddp(x)  # an evaluation forward rebuilds nothing
    assert calls == []
    ddp(x).sum().backward()
    # Announced before the forward that rebuilt the buckets, and only then.
    assert calls == [1]
    assert ddp._has_rebuilt_buckets is True and rebuilt_before_call[-1] is False
    step[0] = 2
    ddp(x).sum().backward()
    assert calls == [1]


def test_a_new_world_gets_a_new_replica_with_its_own_announcement(one_rank: Any) -> None:
    step, calls = [5], []
    model = nn.Linear(4, 1)
    replicas = Replicas(cast(Any, one_rank), in_place=True, step=lambda: step[0],
                        on_bucket_rebuild=lambda: calls.append(step[0]))
    first = replicas.wrap(model)
    first(torch.randn(2, 4)).sum().backward()
    one_rank.generation = 2  # a reconfiguration
    step[0] = 6
    second = replicas.wrap(model)
    assert second is not first
    second(torch.randn(2, 4)).sum().backward()
    assert calls == []  # the new replica's first step
    step[0] = 7
    second(torch.randn(2, 4)).sum().backward()
    assert calls == [7]
