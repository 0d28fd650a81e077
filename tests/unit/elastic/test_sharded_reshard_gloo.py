"""A real re-shard of an FSDP2 model between processes over gloo, without elastic-run.

Four processes live through three worlds, each built on its own prefix of one TCPStore:

* world A, processes 0-2 (3 ranks): train 3 steps; snapshots every 2 steps go to a peer;
* world B, processes 0-3 (4 ranks, process 3 new): the heal re-shards the live shards
  (16 rows: 6/6/4 become 4/4/4/4) at step 3, nothing lost, the newcomer receives its shard
  and the replicated state; train 2 steps (snapshot at step 4);
* world C, processes 0, 1 and 3 (process 2 lost): its shard survives only in its copy at step
  4, so every rank rolls back one step (the survivors from their own snapshots), and trains on;
  it saves a DCP checkpoint (a world of 3 whose mesh equals world A's: torch's DTensor caches
  must not hand it world A's mesh, or the shard offsets are wrong);
* world D, processes 0 and 1: a model built anew (other weights) loads that checkpoint.

The final weights, gathered, equal a single process's training within 1e-9 (float64), and
the optimizer's hyper-parameters (a StepLR schedule) follow; so do the weights world D loaded.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.sharding import shard_linear_layers

pytestmark = pytest.mark.slow

_GLOBAL = 12
_STEPS = 8
_WORLDS = [
    ("A", [0, 1, 2], 0, 3),  # (name, processes in rank order, first step, last step)
    ("B", [0, 1, 2, 3], 3, 5),
    ("C", [0, 1, 3], 4, _STEPS),  # starts at 4: the roll back
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 1)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(_GLOBAL, 8, generator=g, dtype=torch.float64),
            torch.randn(_GLOBAL, 1, generator=g, dtype=torch.float64))


class _Loop:
    """The loop's replicated state: just the step."""

    def __init__(self) -> None:
        self.step = 0

    def loop_small(self) -> dict[str, Any]:
        return {"loop": {"step": self.step}, "user": {}}

    def load_loop_small(self, small: dict[str, Any]) -> None:
        self.step = int(small["loop"]["step"])


def _process(proc: int, port: int, out: str) -> None:
    from checkpointing import CheckpointManager
    from elastic.sharded.copies import ShardCopies
    from elastic.sharded.model import ShardedTraining, ShardedTrainState
    from elastic.sharded.plan import copy_holders
    from elastic.sharded.reshard import reshard_heal

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    training = ShardedTraining(
        _model(), parallelize=shard_linear_layers,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
    copies = ShardCopies(every=2)
    loop = _Loop()
    heal_epoch = 0
    results: dict[str, Any] = {}
    for epoch, (name, procs, _first, last) in enumerate(_WORLDS, start=1):
        if proc not in procs:
            continue
        rank, world = procs.index(proc), len(procs)
        dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        group = dist.group.WORLD
        assert group is not None
        outcome = reshard_heal(training=training, copies=copies, loop=loop,
                               live_step=loop.step if training.current is not None else -1,
                               heal_epoch=heal_epoch, group=group,
                               device=torch.device("cpu"), world_size=world)
        heal_epoch = epoch
        built = outcome.built
        holders = copy_holders([f"node{p}" for p in procs])
        copies.configure(dist.new_group(backend="gloo"), holder=holders[rank],
                         owner=holders.index(rank), shards=built.shards, index=built.index,
                         local_workers=1)
        results[name] = {"step": outcome.result.step, "lost": outcome.result.lost_steps,
                         "received": outcome.result.received,
                         "snapshots": outcome.result.from_snapshots}
        while loop.step < last:
            x, y = _batch(loop.step)
            loss = (built.module(x[rank::world]) - y[rank::world]).square().sum()
            (loss * world / _GLOBAL).backward()
            copies.confirm()  # what the loop's optimizer pre-step hook does
            built.optimizer.step()
            built.optimizer.zero_grad()
            built.scheduler.step()
            loop.step += 1
            if copies.due(loop.step):
                copies.take(loop.step, built.locals(),
                            {**loop.loop_small(), "model": training.small_state(built)})
        copies.settle()
        if name == "C":
            weights = {k: v.full_tensor() for k, v in built.module.state_dict().items()}
            if rank == 0:
                results["lr"] = built.optimizer.param_groups[0]["lr"]
                torch.save(weights, f"{out}.weights.pt")
            with CheckpointManager(f"{out}.ckpt", process_group=group, run_id="r") as mgr:
                mgr.save(loop.step, {"train": ShardedTrainState(training)}).committed.result(
                    timeout=60)
        dist.destroy_process_group()
    copies.close()
    if proc in (0, 1):  # world D loads world C's checkpoint into a new model
        dist.init_process_group("gloo", store=dist.PrefixStore("D", store), rank=proc,
                                world_size=2, timeout=timedelta(seconds=60))
        torch.manual_seed(5)
        fresh = ShardedTraining(_model().apply(lambda m: torch.nn.init.zeros_(m.weight)
                                               if isinstance(m, nn.Linear) else None),
                                parallelize=shard_linear_layers,
                                optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
        fresh.install(fresh.build(torch.device("cpu"), 2))
        with CheckpointManager(f"{out}.ckpt", process_group=dist.group.WORLD) as mgr:
            info = mgr.load({"train": ShardedTrainState(fresh)})
        assert info is not None
        weights = {k: v.full_tensor() for k, v in fresh.require().module.state_dict().items()}
        if proc == 0:
            torch.save(weights, f"{out}.loaded.pt")
        dist.destroy_process_group()
    Path(f"{out}.{proc}.json").write_text(json.dumps(results))


def test_fsdp_state_is_resharded_and_rolled_back_in_place(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    out = str(tmp_path / "r")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(p, store.port, out)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    results = {p: json.loads(Path(f"{out}.{p}.json").read_text()) for p in range(4)}
    assert results[0]["A"] == {"step": -1, "lost": 0, "received": False, "snapshots": False}
    assert results[3]["B"]["step"] == 3 and results[3]["B"]["received"]
    assert all(results[p]["B"]["lost"] == 0 and not results[p]["B"]["snapshots"]
               for p in range(4))
    assert all(results[p]["C"]["step"] == 4 and results[p]["C"]["lost"] == 1
               and results[p]["C"]["snapshots"] for p in (0, 1, 3))

    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    for step in range(_STEPS):
        x, y = _batch(step)
        ((model(x) - y).square().sum() / _GLOBAL).backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    weights = torch.load(f"{out}.weights.pt", weights_only=True)
    worst = max((weights[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert worst < 1e-9, worst
    loaded = torch.load(f"{out}.loaded.pt", weights_only=True)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert results[0]["lr"] == pytest.approx(optim.param_groups[0]["lr"])
