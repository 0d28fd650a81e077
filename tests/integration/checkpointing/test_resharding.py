"""Re-sharding: a checkpoint saved on N gloo ranks restores bit-identically on M ranks.

Each rank holds three kinds of state, so every path DCP takes is covered:

* an FSDP2 (``fully_shard``) model with Adam: parameters and optimizer moments are DTensors
  sharded on dim 0, unevenly on 3 ranks, so loading on another world size really re-slices;
* a plain replicated model with Adam (what DDP holds): DCP writes it once in total and every
  loading rank must read all of it;
* extra state: replicated values (``step``, a tensor) and one tensor per *saving* rank, a key
  only that rank owns, which every loading rank then reads.

The saver writes its gathered full state with ``torch.save`` as the reference; every loading rank
gathers its full state and compares each tensor with ``torch.equal``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from checkpointing import CheckpointManager, ModelOptimizerState

pytestmark = pytest.mark.slow

_STEP = 3
_TIMEOUT_S = 120

# A fork server forks every rank from one process that already imported torch and FSDP, so a
# world of 4 costs a fork per rank instead of an ``import torch`` per rank (2 shared cores).
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(
    ["torch", "torch.distributed.fsdp", "torch._dynamo", "checkpointing.manager"]
)


def _init(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )


def _models(world: int, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    # 18 and 10 rows: uneven shards on 4 and on 3 ranks.
    sharded = torch.nn.Sequential(torch.nn.Linear(8, 18), torch.nn.ReLU(), torch.nn.Linear(18, 10))
    replicated = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    return sharded, replicated


def _train(
    sharded: torch.nn.Module,
    replicated: torch.nn.Module,
    opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    steps: int,
) -> None:
    for i in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + i))
        loss = replicated(sharded(x)).pow(2).mean()
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of model + optimizer, gathered to full size on every rank, keyed by FQN."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            assert not isinstance(v, DTensor), "full_state_dict must gather DTensors"
            out[f"optim.{fqn}.{k}"] = torch.as_tensor(v).clone()
    return out


def _owned(rank: int) -> torch.Tensor:
    return torch.arange(7, dtype=torch.float64) * (rank + 1) + 0.25


def _save_worker(rank: int, world: int, port: int, root: str, ref: str) -> None:
    _init(rank, world, port)
    try:
        sharded, replicated = _models(world, seed=0)
        opt_s = torch.optim.Adam(sharded.parameters(), lr=1e-2)
        opt_r = torch.optim.Adam(replicated.parameters(), lr=1e-2)
        _train(sharded, replicated, (opt_s, opt_r), _STEP)
        extra: dict[str, Any] = {
            "step": _STEP, "note": "resharding", "t": torch.tensor([1.5, -2.0])
        }
        state = {
            "sharded": ModelOptimizerState(sharded, opt_s, extra=extra),
            "replicated": ModelOptimizerState(replicated, opt_r),
            # A key only this rank has: other ranks write nothing for it.
            "owned": {f"r{rank}": _owned(rank)},
        }
        with CheckpointManager(root, run_id="reshard") as mgr:
            info = mgr.save(_STEP, state).committed.result(timeout=_TIMEOUT_S)
            assert info.world_size == world
        expected = {
            "sharded": _full(sharded, opt_s),
            "replicated": _full(replicated, opt_r),
            "owned": {f"r{r}": _owned(r) for r in range(world)},
            "extra": {"step": _STEP, "note": "resharding", "t": torch.tensor([1.5, -2.0])},
        }
        if rank == 0:
            torch.save(expected, ref)
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, root: str, ref: str, saved_world: int) -> None:
    _init(rank, world, port)
    try:
        sharded, replicated = _models(world, seed=100 + rank)
        opt_s = torch.optim.Adam(sharded.parameters(), lr=1e-3)
        opt_r = torch.optim.Adam(replicated.parameters(), lr=1e-3)
        # Optimizer state exists and differs from the saved one before the load.
        _train(sharded, replicated, (opt_s, opt_r), 1)
        extra: dict[str, Any] = {"step": 0, "note": "", "t": torch.zeros(2)}
        owned = {f"r{r}": torch.zeros(7, dtype=torch.float64) for r in range(saved_world)}
        state = {
            "sharded": ModelOptimizerState(sharded, opt_s, extra=extra),
            "replicated": ModelOptimizerState(replicated, opt_r),
            "owned": owned,
        }
        with CheckpointManager(root) as mgr:
            info = mgr.load(state)
        assert info is not None and info.step == _STEP and info.world_size == saved_world
        # The sharded model really is sharded here: this rank holds a slice, not the whole.
        local = sharded[0].weight
        assert isinstance(local, DTensor) and local.to_local().shape[0] < local.shape[0]
        expected = torch.load(ref, weights_only=True)
        got = {
            "sharded": _full(sharded, opt_s),
            "replicated": _full(replicated, opt_r),
            "owned": owned,
        }
        for part in ("sharded", "replicated", "owned"):
            want, have = expected[part], got[part]
            assert want.keys() == have.keys(), (rank, part, sorted(want), sorted(have))
            for key in want:
                assert want[key].dtype == have[key].dtype, (rank, part, key)
                assert torch.equal(want[key], have[key]), (rank, part, key)
        assert extra["step"] == _STEP and extra["note"] == "resharding"
        assert torch.equal(extra["t"], expected["extra"]["t"])
    finally:
        dist.destroy_process_group()


def _run(fn: Any, world: int, *args: Any) -> None:
    """Run ``fn(rank, world, port, *args)`` on ``world`` forked ranks; fail on any bad exit."""
    master = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    procs = [
        _CTX.Process(target=fn, args=(rank, world, master.port, *args), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + _TIMEOUT_S
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"{fn.__name__} on {world} ranks exited with {codes}"
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(10)
        del master


def _shard_count(ckpt: Path, fqn: str) -> int:
    meta = FileSystemReader(str(ckpt)).read_metadata()
    return len(meta.state_dict_metadata[fqn].chunks)  # type: ignore[union-attr]


@pytest.mark.parametrize(("saved", "restored"), [(4, (2, 3)), (2, (4,))])
def test_checkpoint_restores_bit_identical_on_another_world_size(
    tmp_path: Path, saved: int, restored: tuple[int, ...]
) -> None:
    root, ref = tmp_path / "ckpt", tmp_path / "expected.pt"
    _run(_save_worker, saved, str(root), str(ref))
    ckpt = root / f"step-{_STEP:010d}_r0000"
    # Genuinely sharded: one chunk per saving rank for the FSDP weight and its Adam moment.
    assert _shard_count(ckpt, "sharded.model.0.weight") == saved
    assert _shard_count(ckpt, "sharded.optim.state.0.weight.exp_avg") == saved
    # Every saving rank wrote a shard file (the replicated state is spread, not all on rank 0).
    assert {p.name.split("_")[2] for p in ckpt.glob("*.distcp")} == {str(r) for r in range(saved)}
    for world in restored:
        _run(_load_worker, world, str(root), str(ref), saved)
    assert os.path.getsize(ref) > 0
