"""HSDP's world agreement before the optimizer step (:mod:`elastic.sharded.step_agreement`),
on a real FSDP2 HSDP model of four gloo processes.

The mesh is replicate 2 x shard 2: ranks 0 and 1 are replica group 0 (shards 0 and 1), and
ranks 2 and 3 are replica group 1. Every rank trains step 1. In step 2, rank 3 dies at its
backward's last replica all-reduce, with rank 1. At that point its reduce-scatters with
rank 2 are done. So rank 1's backward fails, while ranks 0 and 2, whose last all-reduce is
with each other, finish theirs.

Without the agreement, ranks 0 and 2 apply step 2 and rank 1 does not. Shard 0's survivors are
then at step 2 and shard 1's only survivor at step 1: no step is held whole, which is the split
a node's loss left in a full run. With the agreement no survivor applies step 2. The first
case shows that the scenario reproduces the split; the second is the fix.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.sharding import shard_linear_layers

pytestmark = pytest.mark.slow

_VICTIM = 3


def _process(rank: int, port: int, agree: bool, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from elastic.sharded.step_agreement import world_agreement_hook

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4,
                            timeout=timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicas = mesh.get_group("replicate")
    torch.manual_seed(0)
    model = shard_linear_layers(nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if agree:
        optimizer.register_step_pre_hook(world_agreement_hook(
            group=lambda: None, device=lambda: torch.device("cpu")))

    # Counts the backward's replica all-reduces (step 1), so that the victim can die at the
    # last one of step 2. FSDP calls them through the module attribute.
    real_all_reduce = dist.all_reduce
    calls = {"n": 0, "die_at": -1}

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("group") is replicas:
            calls["n"] += 1
            if calls["n"] == calls["die_at"]:
                os._exit(0)
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def local() -> list[list[float]]:
        return [p.to_local().detach().flatten().tolist() for p in model.parameters()]

    train(1)
    per_step = calls["n"]
    after_step_1 = local()
    if rank == _VICTIM:
        calls["die_at"] = 2 * per_step
    error = ""
    try:
        train(2)
    except Exception as exc:  # the peer's loss, seen by a collective
        error = type(exc).__name__
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "stepped": local() != after_step_1, "error": error, "all_reduces": per_step}))
    os._exit(0)  # the world is broken: leave without tearing it down


def _run(tmp_path: Path, agree: bool) -> dict[int, dict[str, Any]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(r, store.port, agree, str(tmp_path)))
             for r in range(4)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=180)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text())
            for r in range(4) if r != _VICTIM}


def test_without_the_agreement_a_rank_lost_late_in_a_backward_splits_the_survivors(
        tmp_path: Path) -> None:
    results = _run(tmp_path, agree=False)
    assert results[0]["all_reduces"] > 0
    # Ranks 0 and 2 applied step 2; rank 1, whose all-reduce partner died, did not.
    assert {r: res["stepped"] for r, res in results.items()} == {0: True, 1: False, 2: True}, \
        results
    assert results[1]["error"], results


def test_with_the_agreement_no_survivor_applies_the_step_a_lost_rank_cut_short(
        tmp_path: Path) -> None:
    results = _run(tmp_path, agree=True)
    assert {r: res["stepped"] for r, res in results.items()} == {0: False, 1: False, 2: False}, \
        results
    assert all(res["error"] for res in results.values()), results
