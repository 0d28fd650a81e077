"""Commit markers: a framework checkpoint counts only once committed, and only while it is
whole (local disk, and an S3-compatible server for the URL case)."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from elastic.integrations._commits import MARKER_DIR, CommitLog
from tests.support.moto_s3 import moto_s3, s3_options


def _file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_a_file_counts_once_committed_and_the_newest_committed_one_wins(tmp_path: Path) -> None:
    log = CommitLog(str(tmp_path))
    _file(tmp_path / "step-5.ckpt", 100)
    _file(tmp_path / "step-10.ckpt", 100)
    assert log.newest() is None  # written, not committed
    log.commit("step-5.ckpt", 5, {"global_batch_size": 8})
    _file(tmp_path / "step-15.ckpt", 60)  # a newer one, half-written: no marker
    newest = log.newest()
    assert newest is not None and (newest.name, newest.step) == ("step-5.ckpt", 5)
    assert newest.path == str(tmp_path / "step-5.ckpt")
    assert newest.meta == {"global_batch_size": 8}
    marker = json.loads((tmp_path / MARKER_DIR / "step-5.ckpt.json").read_text())
    assert marker["files"] == {"": 100} and marker["step"] == 5
    log.commit("step-10.ckpt", 10, {})
    assert [c.step for c in log.committed()] == [5, 10]


def test_a_checkpoint_cut_short_or_deleted_after_its_commit_no_longer_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = CommitLog(str(tmp_path))
    for step in (5, 10, 15):
        _file(tmp_path / f"step-{step}.ckpt", 100)
        log.commit(f"step-{step}.ckpt", step, {})
    _file(tmp_path / "step-15.ckpt", 40)  # rewritten in place and cut off by a crash
    (tmp_path / "step-10.ckpt").unlink()
    newest = log.newest()
    assert newest is not None and newest.step == 5
    assert "no longer complete" in caplog.text


def test_a_directory_checkpoint_needs_every_file_it_was_committed_with(tmp_path: Path) -> None:
    log = CommitLog(str(tmp_path))
    for rank in range(2):
        _file(tmp_path / "checkpoint-4" / f"rng_state_{rank}.pth", 10)
    _file(tmp_path / "checkpoint-4" / "model.safetensors", 300)
    log.commit("checkpoint-4", 4, {})
    marker = json.loads((tmp_path / MARKER_DIR / "checkpoint-4.json").read_text())
    assert marker["files"] == {"model.safetensors": 300, "rng_state_0.pth": 10,
                               "rng_state_1.pth": 10}
    _file(tmp_path / "checkpoint-4" / "extra.txt", 5)  # more is fine
    assert log.newest() is not None
    (tmp_path / "checkpoint-4" / "rng_state_1.pth").unlink()
    assert log.newest() is None


def test_rewriting_removing_and_rotated_checkpoints(tmp_path: Path) -> None:
    log = CommitLog(str(tmp_path))
    for step in (2, 4):
        _file(tmp_path / f"checkpoint-{step}" / "model.bin", 10)
        log.commit(f"checkpoint-{step}", step, {})
    log.invalidate("checkpoint-4")  # about to be written again
    assert [c.step for c in log.committed()] == [2]
    log.invalidate("checkpoint-4")  # no marker: nothing to do
    log.remove("checkpoint-2")
    assert not (tmp_path / "checkpoint-2").exists() and log.committed() == []
    _file(tmp_path / "checkpoint-6" / "model.bin", 10)
    log.commit("checkpoint-6", 6, {})
    _file(tmp_path / "checkpoint-8" / "model.bin", 10)
    log.commit("checkpoint-8", 8, {})
    fsspec.filesystem("file").rm(str(tmp_path / "checkpoint-6"), recursive=True)  # a rotation
    log.forget_missing()
    assert sorted(p.name for p in (tmp_path / MARKER_DIR).iterdir()) == ["checkpoint-8.json"]


def test_markers_it_did_not_write_are_ignored(tmp_path: Path) -> None:
    log = CommitLog(str(tmp_path))
    _file(tmp_path / "a.ckpt", 10)
    (tmp_path / MARKER_DIR).mkdir()
    (tmp_path / MARKER_DIR / "a.ckpt.json").write_text('{"step": 3}')
    (tmp_path / MARKER_DIR / "b.ckpt.json").write_text("not json")
    assert log.committed() == []
    with pytest.raises(FileNotFoundError, match="no files to commit"):
        log.commit("missing.ckpt", 1, {})


@pytest.mark.s3
def test_checkpoints_on_s3_are_committed_and_verified_the_same_way() -> None:
    with moto_s3() as endpoint:
        options = s3_options(endpoint)
        fs = fsspec.filesystem("s3", **options)
        fs.mkdir("bucket")
        fs.pipe("bucket/run/step-3.ckpt", b"y" * 50)
        log = CommitLog("s3://bucket/run", options)
        log.commit("step-3.ckpt", 3, {"world": 2})
        fs.pipe("bucket/run/step-6.ckpt", b"y" * 50)  # never committed
        newest = log.newest()
        assert newest is not None and newest.step == 3
        assert newest.path == "s3://bucket/run/step-3.ckpt"
        fs.pipe("bucket/run/step-3.ckpt", b"y" * 20)
        assert CommitLog("s3://bucket/run", options).newest() is None
