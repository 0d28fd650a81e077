"""A heal of CUDA DTensor shards lands on the device: FSDP2 state re-sharded in place between
processes over gloo, as the in-place CUDA test runs its workers (all on this GPU).

Three processes live through three worlds (one TCPStore, a prefix per world):

* world A, processes 0 and 1: ``fully_shard`` on a CUDA mesh; Adam moments set to known
  values; a snapshot of every shard goes to host memory (pinned) and to the peer;
* world B, processes 0-2 (process 2 new): the heal re-shards the live CUDA shards (2 -> 3
  shards, uneven) through host buffers; the newcomer's shards are on its GPU;
* world C, processes 1 and 2 (process 0 lost): process 0's shard is taken from process 1's
  host copy of it and lands on the device again.

After each heal every rank's parameter and moment shards are CUDA tensors equal to the rows
of the known full tensors that ``torch.chunk`` gives its shard. Skipped without CUDA::

    python -m pytest -q -s tests/gpu/test_sharded_cuda.py
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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device (torch.cuda.is_available() is False): the gpu "
                              "tests run where CUDA is present"),
]

_STEP = 5
_WORLDS = [("A", [0, 1]), ("B", [0, 1, 2]), ("C", [1, 2])]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _expected() -> dict[str, torch.Tensor]:
    """Full parameters and moments (``exp_avg = 2 w``, ``exp_avg_sq = w * w``)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in _model().named_parameters():
        w = param.detach()
        out[f"p:{name}"], out[f"o:{name}:exp_avg"], out[f"o:{name}:exp_avg_sq"] = w, 2 * w, w * w
    return out


def _process(proc: int, port: int, out: str, device_type: str = "cuda") -> None:
    """One process through the worlds it belongs to (``device_type="cpu"``: the same run
    on CPU, to try this test where there is no GPU)."""
    from elastic.sharded.copies import ShardCopies
    from elastic.sharded.model import ShardedTraining
    from elastic.sharded.plan import copy_holders, shard_range
    from elastic.sharded.reshard import reshard_heal
    from tests.unit.elastic.test_sharded_reshard_gloo import _Loop

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # CUDA is initialised: the mesh keeps this device
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    training = ShardedTraining(_model(), parallelize=shard_linear_layers,
                               optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    copies, loop, heal_epoch = ShardCopies(every=1), _Loop(), 0
    expected = _expected()
    results: dict[str, Any] = {}
    for epoch, (name, procs) in enumerate(_WORLDS, start=1):
        if proc not in procs:
            continue
        rank, world = procs.index(proc), len(procs)
        dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        group = dist.group.WORLD
        assert group is not None
        outcome = reshard_heal(training=training, copies=copies, loop=loop,
                               live_step=loop.step if training.current is not None else -1,
                               heal_epoch=heal_epoch, group=group, device=device,
                               world_size=world)
        heal_epoch, built = epoch, outcome.built
        if name == "A":  # known moments, then a snapshot of step 5 to the peer
            built.add_optimizer_entries([[fqn, key, "float64"] for fqn in built.params
                                         for key in ("exp_avg", "exp_avg_sq")])
            with torch.no_grad():
                for param in built.params.values():
                    state = built.optimizer.state[param]
                    state["exp_avg"].to_local().copy_(2 * param.to_local())
                    state["exp_avg_sq"].to_local().copy_(param.to_local() ** 2)
                    state["step"] = torch.tensor(float(_STEP))
            loop.step = _STEP
            holders = copy_holders([f"node{p}" for p in procs])
            copies.configure(dist.new_group(backend="gloo"), holder=holders[rank],
                             owner=holders.index(rank), shards=built.shards,
                             index=built.index, local_workers=1)
            copies.take(_STEP, built.locals(),
                        {**loop.loop_small(), "model": training.small_state(built)})
            copies.confirm()
        checked = {}
        for entry in built.entries():
            local = built.local(entry.name)
            start, stop = shard_range(entry.rows, built.shards, built.index)
            want = expected[entry.name][start:stop]
            checked[entry.name] = (local.device == device and torch.equal(local.cpu(), want))
        results[name] = {"step": outcome.result.step, "snapshots": outcome.result.from_snapshots,
                         "lost": outcome.result.lost_steps,
                         "received": outcome.result.received, "all_on_device_and_equal":
                         all(checked.values()), "entries": len(checked)}
        copies.settle()
        dist.destroy_process_group()
    copies.close()
    Path(f"{out}.{proc}.json").write_text(json.dumps(results))


@pytest.mark.timeout(300)
def test_cuda_dtensor_shards_are_resharded_and_restored_onto_the_device(
        tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    out = str(tmp_path / "r")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(p, store.port, out)) for p in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    results = {p: json.loads(Path(f"{out}.{p}.json").read_text()) for p in range(3)}
    for proc, worlds in results.items():
        for name, result in worlds.items():
            assert result["all_on_device_and_equal"] and result["entries"] == 12, (
                proc, name, result)
    assert results[2]["B"]["step"] == _STEP and results[2]["B"]["received"]
    assert all(results[p]["B"]["lost"] == 0 for p in range(3))
    assert all(results[p]["C"]["step"] == _STEP and results[p]["C"]["snapshots"]
               and results[p]["C"]["lost"] == 0 for p in (1, 2))  # process 0's rows: a copy
