from __future__ import annotations

import uuid
from typing import Any

import pytest

from checkpointing.storage import Storage


def _memory_storage() -> Storage:
    return Storage(f"memory://ckpt-{uuid.uuid4().hex}")


def test_transient_write_errors_are_retried_until_the_write_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _memory_storage()
    real = storage.fs.pipe_file
    calls = {"n": 0}

    def flaky(path: str, data: bytes, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionResetError("connection reset by peer")
        return real(path, data, **kw)

    monkeypatch.setattr(storage.fs, "pipe_file", flaky)
    storage.write_bytes(storage.path("a.bin"), b"payload")
    assert calls["n"] == 3
    assert storage.read_bytes(storage.path("a.bin")) == b"payload"


def test_permission_errors_are_not_retried_and_name_the_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = _memory_storage()
    calls = {"n": 0}

    def denied(path: str, data: bytes, **kw: Any) -> Any:
        calls["n"] += 1
        raise PermissionError("denied")

    monkeypatch.setattr(storage.fs, "pipe_file", denied)
    with pytest.raises(Exception, match=r"^Access to \(.*a\.bin\) under \(memory://ckpt-"):
        storage.write_bytes(storage.path("a.bin"), b"x")
    assert calls["n"] == 1


def test_listing_a_missing_prefix_is_empty() -> None:
    storage = _memory_storage()
    assert storage.list_names(storage.path("nothing")) == []
