"""Restore from memory: real memory stores (TCP on 127.0.0.1) and a real CheckpointManager.

Storage is a local directory. Damaging storage's shard after a save shows which copy a load
read: a load that still returns the saved values read memory.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpointing import CheckpointManager
from checkpointing.layout import format_dir_name
from checkpointing.memory_store import MemoryStore, StoredFile, recv_message, send_message
from checkpointing.memory_tier import MEMORY_STORE_ENV, MemoryTier

STEP_DIR = format_dir_name(10, 0)


@pytest.fixture
def stores() -> Iterator[list[MemoryStore]]:
    made = [MemoryStore("127.0.0.1"), MemoryStore("127.0.0.1")]
    yield made
    for store in made:
        store.close()


def _manager(root: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
             ) -> CheckpointManager:
    """A one-rank manager whose node store is ``stores[0]`` and whose peer is ``stores[1]``."""
    monkeypatch.setenv(MEMORY_STORE_ENV, stores[0].address)
    manager = CheckpointManager(str(root), async_mode="disabled")
    assert manager.memory is not None
    manager.memory.bind([s.address for s in stores])  # as if rank 1 ran on the peer node
    return manager


def _save(manager: CheckpointManager, step: int, value: float) -> None:
    manager.save(step, {"w": torch.full((256,), value)}).committed.result(timeout=60)


def _load(manager: CheckpointManager) -> tuple[int, float]:
    state = {"w": torch.zeros(256)}
    info = manager.load(state)
    assert info is not None
    assert torch.all(state["w"] == state["w"][0])
    return info.step, float(state["w"][0])


def _damage_storage(root: Path, step_dir: str = STEP_DIR) -> None:
    """Same size, other bytes: only a CRC check notices."""
    for shard in (root / step_dir).glob("*.distcp"):
        data = bytearray(shard.read_bytes())
        data[-64:] = bytes(64)
        shard.write_bytes(bytes(data))


def _shard_key(manager: CheckpointManager) -> tuple[str, str]:
    assert manager.memory is not None
    return f"{manager.memory.namespace}/{STEP_DIR}", "__0_0.distcp"


def test_each_committed_save_is_held_by_the_node_store_and_its_peer(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager(tmp_path, stores, monkeypatch)
    _save(manager, 10, 1.5)
    key = f"{manager.memory.namespace}/{STEP_DIR}"  # type: ignore[union-attr]
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / STEP_DIR).iterdir()
               if p.name != "COMMIT.json"}
    for store in stores:
        assert {rel: size for rel, (size, _) in store.listing(key).items()} == on_disk
    # Only the newest directory per job and root stays in memory (an older one is never
    # storage's newest again).
    for step in (20, 30):
        _save(manager, step, float(step))
    for store in stores:
        assert {d.rpartition("/")[2] for d in store._dirs} == {format_dir_name(30, 0)}


def test_after_an_in_place_world_change_copies_go_to_this_nodes_store_only(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The old world's peer may be the node that was lost: each save would wait out its
    # connect timeout. The next load binds the new world's stores.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        manager = _manager(tmp_path, stores, monkeypatch)
        manager.rebind(dist.new_group(backend="gloo"), round=1)
        _save(manager, 10, 1.5)
        key = f"{manager.memory.namespace}/{format_dir_name(10, 1)}"  # type: ignore[union-attr]
        assert stores[0].listing(key) and not stores[1].listing(key)
        manager.close()
    finally:
        dist.destroy_process_group()


def test_a_load_reads_memory_when_it_holds_storages_newest_checkpoint(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(_manager(tmp_path, stores, monkeypatch), 10, 1.5)
    _damage_storage(tmp_path)
    fresh = _manager(tmp_path, stores, monkeypatch)
    assert _load(fresh) == (10, 1.5)  # storage's shard is damaged: this came from memory
    assert fresh.last_load_source == "memory"


def test_the_peer_copy_serves_a_node_whose_memory_is_gone(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(_manager(tmp_path, stores, monkeypatch), 10, 2.5)
    _damage_storage(tmp_path)
    fresh = _manager(tmp_path, stores, monkeypatch)
    stores[0].close()  # this node's agent (and its memory) is gone: the peer's copy is left
    assert _load(fresh) == (10, 2.5)
    assert fresh.last_load_source == "memory"


def test_memory_older_than_storages_newest_is_not_used(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager(tmp_path, stores, monkeypatch)
    _save(manager, 10, 1.0)
    manager.memory = None  # step 20 reaches storage only (its copies were lost, say)
    _save(manager, 20, 2.0)
    fresh = _manager(tmp_path, stores, monkeypatch)
    assert _load(fresh) == (20, 2.0)
    assert fresh.last_load_source == "storage"


def test_a_damaged_or_missing_memory_copy_falls_back_to_storage(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _manager(tmp_path, stores, monkeypatch)
    _save(first, 5, 0.5)
    _save(first, 10, 3.0)
    probe = _manager(tmp_path, stores, monkeypatch)
    key, rel = _shard_key(probe)
    stored = stores[1].get(key, rel)
    assert stored is not None
    # This node's copy of the shard is gone and the peer's rotted (right size and recorded
    # CRC32, wrong bytes): the shard fails its check and is read from storage, the rest of
    # the checkpoint from memory.
    del stores[0]._dirs[key][rel]
    stores[1]._dirs[key][rel] = StoredFile(bytes(len(stored.data)), stored.crc32)
    fresh = _manager(tmp_path, stores, monkeypatch)
    assert _load(fresh) == (10, 3.0)
    assert fresh.last_load_source == "mixed"
    # No store holds the shard at all: the whole checkpoint is read from storage.
    del stores[1]._dirs[key][rel]
    again = _manager(tmp_path, stores, monkeypatch)
    assert _load(again) == (10, 3.0)
    assert again.last_load_source == "storage"
    # Storage's copy damaged too, and memory's bad: step 10 is refused, and the load goes
    # back to the newest good checkpoint (step 5), as a load from storage alone does.
    stores[1]._dirs[key][rel] = StoredFile(bytes(len(stored.data)), stored.crc32)
    _damage_storage(tmp_path)
    last = _manager(tmp_path, stores, monkeypatch)
    assert _load(last) == (5, 0.5)
    assert last.last_load_source == "storage"


def test_the_store_refuses_a_file_whose_crc_does_not_match(stores: list[MemoryStore]) -> None:
    host, _, port = stores[0].address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        send_message(conn, {"op": "put", "dir": "ns/" + STEP_DIR, "rel": "x", "size": 3,
                            "crc32": 1}, b"abc")
        assert recv_message(conn) == {"ok": False, "error": "CRC32 mismatch"}
    assert stores[0].held_bytes() == 0
    tier = MemoryTier(stores[0].address, "ns")
    assert tier.fetch(stores[0].address, STEP_DIR, "x") is None
    assert tier.plan(STEP_DIR, {}) is None  # nothing to read from memory: storage


# -- two ranks on two "nodes", then one of them is gone ---------------------------------------


def _rank(rank: int, world: int, port: int, root: str, addresses: list[str],
          value: float) -> None:
    os.environ[MEMORY_STORE_ENV] = addresses[rank]
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        with CheckpointManager(root, async_mode="disabled") as manager:
            assert manager.memory is not None and manager.memory.endpoints == addresses
            manager.save(10, {"w": torch.full((256,), value)}).committed.result(timeout=60)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_node_lost_after_a_save_is_restored_from_its_peers_memory(
    tmp_path: Path, stores: list[MemoryStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    addresses = [s.address for s in stores]
    mp.spawn(_rank, args=(2, master.port, str(tmp_path), addresses, 4.0), nprocs=2, join=True)
    del master
    # Each node holds its own files and the other's.
    key = next(iter(stores[0]._dirs))
    assert stores[0].listing(key) == stores[1].listing(key)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(stores[0].listing(key))
    stores[1].close()  # node 1 is lost with its memory
    _damage_storage(tmp_path)
    monkeypatch.setenv(MEMORY_STORE_ENV, stores[0].address)
    survivor = CheckpointManager(str(tmp_path), async_mode="disabled")  # the world of one left
    assert _load(survivor) == (10, 4.0)
    assert survivor.last_load_source == "memory"
