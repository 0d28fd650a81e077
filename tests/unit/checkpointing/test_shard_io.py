from __future__ import annotations

import errno
import os
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from checkpointing import shard_io
from checkpointing.shard_io import ShardFileSystem, ShardWriter
from checkpointing.storage import Storage, is_transient


def _memory_storage(deadline: float = 10.0) -> Storage:
    return Storage(f"memory://shards-{uuid.uuid4().hex}", retry_deadline_s=deadline)


def _state() -> dict[str, torch.Tensor]:
    # One tensor above the small-write threshold so both write paths are used.
    return {"big": torch.arange(600_000, dtype=torch.float32), "small": torch.ones(3)}


def test_transport_errors_are_transient_and_permanent_ones_are_not() -> None:
    from aiohttp import ServerDisconnectedError
    from botocore.exceptions import (
        ConnectionClosedError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionClosedError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ServerDisconnectedError())
    assert is_transient(ConnectionResetError("reset"))
    assert is_transient(OSError(errno.EIO, "503 SlowDown"))
    assert not is_transient(NoCredentialsError())
    assert not is_transient(FileNotFoundError("gone"))
    assert not is_transient(OSError(errno.ENOSPC, "disk full"))
    assert not is_transient(ValueError("bug"))


def test_dcp_save_through_the_seam_retries_a_reset_shard_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _memory_storage()
    real = storage.fs.pipe_file
    failures = {"left": 2}

    def flaky(path: str, data: Any, **kw: Any) -> Any:
        if path.endswith(".distcp") and failures["left"]:
            failures["left"] -= 1
            raise ConnectionResetError("connection reset by peer")
        return real(path, data, **kw)

    monkeypatch.setattr(storage.fs, "pipe_file", flaky)
    writer = ShardWriter(storage, storage.path("ckpt"))
    state = _state()
    dcp_save(state, storage_writer=writer, no_dist=True)
    assert failures["left"] == 0 and storage.retries == 2
    written = writer.written()
    assert set(written) == {"__0_0.distcp", ".metadata"}
    for rel, entry in written.items():
        data = storage.read_bytes(storage.path("ckpt", rel))
        assert entry.size == len(data) and entry.crc32 == zlib.crc32(data)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_load(out, storage_reader=FsspecReader(storage.url_of("ckpt")), no_dist=True)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_an_outage_longer_than_the_deadline_fails_the_write_with_the_last_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _memory_storage(deadline=0.3)
    calls = {"n": 0}

    def down(path: str, data: Any, **kw: Any) -> Any:
        calls["n"] += 1
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(storage.fs, "pipe_file", down)
    fs = ShardFileSystem(storage)
    with pytest.raises(ConnectionRefusedError), fs.create_stream(storage.path("x.bin"), "wb") as s:
        s.write(b"payload")
    assert calls["n"] >= 2 and fs.written == {}


def test_local_shard_is_complete_when_fsynced_and_checksummed_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = Storage(str(tmp_path))
    path = str(tmp_path / "shard.bin")
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(shard_io.os, "fsync", spy)
    fs = ShardFileSystem(storage)
    payload = [b"h" * 10, os.urandom(3 << 20), b"tail" * 100]
    with fs.create_stream(path, "wb") as s:
        for chunk in payload:
            s.write(chunk)
        s.close()  # DCP closes the stream inside the block, after its last write
    data = b"".join(payload)
    # The file fsync saw every byte (nothing was still in a user-space buffer).
    assert len(data) in synced
    assert Path(path).read_bytes() == data
    entry = fs.written[path]
    assert entry.size == len(data) and entry.crc32 == zlib.crc32(data)


def test_failed_local_write_leaves_no_partial_file(tmp_path: Path) -> None:
    fs = ShardFileSystem(Storage(str(tmp_path)))
    path = str(tmp_path / "shard.bin")
    with pytest.raises(RuntimeError), fs.create_stream(path, "wb") as s:
        s.write(b"partial")
        raise RuntimeError("serialisation failed")
    assert not os.path.exists(path) and fs.written == {}


def test_rename_carries_the_entry_and_survives_a_repeated_move(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    fs = ShardFileSystem(storage)
    src, dst = str(tmp_path / ".metadata.tmp"), str(tmp_path / ".metadata")
    with fs.create_stream(src, "wb") as s:
        s.write(b"meta")
    fs.rename(src, dst)
    assert set(fs.written) == {dst} and Path(dst).read_bytes() == b"meta"
    # A retry of a move whose first try landed finds the source gone and the target there.
    storage.rename(src, dst)


def test_local_write_bytes_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    target = storage.path("latest.json")
    storage.write_bytes(target, b"one")
    storage.write_bytes(target, b"two")
    assert Path(target).read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json"]


def test_bad_retry_deadline_is_rejected_naming_it() -> None:
    message = r"^Storage retry deadline \(0\) must be a positive number of seconds; pass e\.g\. "
    with pytest.raises(ValueError, match=message + r"retry_deadline_s=\d"):
        Storage("memory://x", retry_deadline_s=0)
