from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from checkpointing import CheckpointManager, ModelOptimizerState
from checkpointing.errors import CheckpointError
from tests.integration.checkpointing.conftest import (
    assert_bit_identical,
    flat_state,
    make_model_and_optimizer,
    train_steps,
)

pytestmark = pytest.mark.slow


def _save_worker(rank: int, world: int, port: int, root: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        model, optim = make_model_and_optimizer()
        train_steps(model, optim, 3)
        with CheckpointManager(root, run_id="mp") as mgr:
            state = {"app": ModelOptimizerState(model, optim, extra={"step": 3})}
            info = mgr.save(3, state).committed.result(timeout=60)
            assert info.world_size == world
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, root: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        model, optim = make_model_and_optimizer()
        train_steps(model, optim, 3)
        expected = flat_state(model, optim)
        model2, optim2 = make_model_and_optimizer(seed=7 + rank)
        train_steps(model2, optim2, 1)
        extra: dict[str, object] = {"step": 0}
        with CheckpointManager(root) as mgr:
            info = mgr.load({"app": ModelOptimizerState(model2, optim2, extra=extra)})
        assert info is not None and info.step == 3 and info.world_size == 1
        assert extra == {"step": 3}
        assert_bit_identical(expected, flat_state(model2, optim2))
    finally:
        dist.destroy_process_group()


def test_one_rank_save_is_restored_on_two_ranks_bit_identical(tmp_path: Path) -> None:
    model, optim = make_model_and_optimizer()
    train_steps(model, optim, 3)
    with CheckpointManager(str(tmp_path)) as mgr:
        state = {"app": ModelOptimizerState(model, optim, extra={"step": 3})}
        mgr.save(3, state).committed.result(timeout=60)
    world = 2
    master = dist.TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    mp.spawn(_load_worker, args=(world, master.port, str(tmp_path)), nprocs=world, join=True)
    del master


def test_two_ranks_save_replicated_state_once_and_one_rank_restores_it_bit_identical(
    tmp_path: Path,
) -> None:
    world = 2
    master = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    mp.spawn(_save_worker, args=(world, master.port, str(tmp_path)), nprocs=world, join=True)
    del master

    d = tmp_path / "step-0000000003_r0000"
    record = json.loads((d / "COMMIT.json").read_text())
    assert record["world_size"] == world
    shards = {name: entry["size"] for name, entry in record["files"].items()
              if name.endswith(".distcp")}
    assert shards == {p.name: p.stat().st_size for p in d.glob("*.distcp")}
    # Both ranks wrote a share: the replicated state is spread over them.
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"]
    assert all(size > 0 for size in shards.values())
    # Every item is stored in exactly one place, and every byte of a shard belongs to one item.
    stored = FileSystemReader(str(d)).read_metadata().storage_data
    per_file: dict[str, int] = {}
    for info in stored.values():
        per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    assert per_file == shards
    # Written once in total: the two ranks wrote exactly the bytes one rank alone writes for
    # the same state (each replicated tensor twice would double it).
    alone = tmp_path / "one-rank"
    model, optim = make_model_and_optimizer()
    train_steps(model, optim, 3)
    with CheckpointManager(str(alone), run_id="mp") as mgr:
        mgr.save(3, {"app": ModelOptimizerState(model, optim, extra={"step": 3})}
                 ).committed.result(timeout=60)
    one_rank = sum(p.stat().st_size for p in alone.glob("step-*/*.distcp"))
    assert sum(shards.values()) == one_rank, (shards, one_rank)

    model, optim = make_model_and_optimizer()
    train_steps(model, optim, 3)
    expected = flat_state(model, optim)
    model2, optim2 = make_model_and_optimizer(seed=9)
    extra: dict[str, object] = {"step": 0}
    with CheckpointManager(str(tmp_path)) as mgr:
        info = mgr.load({"app": ModelOptimizerState(model2, optim2, extra=extra)})
    assert info is not None and info.step == 3 and info.world_size == world
    assert extra == {"step": 3}
    assert_bit_identical(expected, flat_state(model2, optim2))


def _unusable_root_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        CheckpointManager(root)
    except CheckpointError as exc:
        Path(out, f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def test_an_unusable_root_fails_every_rank_with_rank_0s_error(tmp_path: Path) -> None:
    """Only rank 0 looks at the root, but every rank raises its one sentence: a job whose
    ranks all die of the same error ends at once with it."""
    root = tmp_path / "a-file"
    root.write_text("not a directory")
    world = 2
    master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    mp.spawn(_unusable_root_worker, args=(world, master.port, str(root), str(tmp_path)),
             nprocs=world, join=True)
    del master
    errors = {(tmp_path / f"rank{r}.txt").read_text() for r in range(world)}
    assert errors == {f"CheckpointError: Checkpoint URL ({root}) is a file, not a directory; "
                      "pass a directory or prefix instead."}


def _rebind_worker(rank: int, world: int, port: int, root: str, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        model, optim = make_model_and_optimizer()
        state = {"app": ModelOptimizerState(model, optim, extra={"step": 1})}
        with CheckpointManager(root, run_id="rebind", round=1,
                               process_group=dist.new_group(backend="gloo")) as mgr:
            copied = threading.Event()
            release = threading.Event()

            def hold() -> None:  # the save of step 1 is on the I/O thread, not yet written
                copied.set()
                assert release.wait(60)

            first = mgr.save(1, state, after_copy=hold)
            assert copied.wait(60)
            # An in-place reconfiguration moves the manager to the next world meanwhile.
            mgr.rebind(dist.new_group(backend="gloo"), round=2)
            release.set()
            refused = first.committed.exception(timeout=60)
            second = mgr.save(2, state).committed.result(timeout=60)
            mgr.verify(second)  # its record's sizes and CRC32s are its own files'
            with open(f"{out}.{rank}", "w") as f:
                json.dump({"refused": str(refused), "second": [second.step, second.round]}, f)
    finally:
        dist.destroy_process_group()


def test_a_save_in_flight_when_the_world_changes_stays_on_its_world_and_does_not_commit(
    tmp_path: Path,
) -> None:
    world = 2
    master = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    out = str(tmp_path / "out")
    mp.spawn(_rebind_worker, args=(world, master.port, str(tmp_path / "ckpt"), out),
             nprocs=world, join=True)
    del master
    for rank in range(world):
        seen = json.loads(Path(f"{out}.{rank}").read_text())
        assert "replaced by round 2" in seen["refused"], seen
        assert seen["second"] == [2, 2]
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        latest = mgr.latest()
        assert latest is not None and (latest.step, latest.round) == (2, 2)
    commits = sorted(p.parent.name for p in (tmp_path / "ckpt").glob("*/COMMIT.json"))
    assert commits == ["step-0000000002_r0002"], commits
