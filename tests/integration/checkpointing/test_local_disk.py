from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import load as stock_dcp_load

from checkpointing import CheckpointManager, ModelOptimizerState
from checkpointing.errors import (
    CheckpointCommitError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
)
from tests.integration.checkpointing.conftest import (
    assert_bit_identical,
    flat_state,
    make_model_and_optimizer,
    train_steps,
)


def _save_at(
    mgr: CheckpointManager,
    step: int,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    extra: dict[str, object] | None = None,
) -> None:
    state = {"app": ModelOptimizerState(model, optim, extra=extra or {"step": step})}
    mgr.save(step, state).committed.result(timeout=60)


def _flip_byte_in_a_shard(directory: Path) -> None:
    shard = sorted(directory.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_save_then_load_restores_model_optimizer_and_extra_bit_identical(tmp_path: Path) -> None:
    model, optim = make_model_and_optimizer()
    train_steps(model, optim, 3)
    expected = flat_state(model, optim)
    with CheckpointManager(str(tmp_path)) as mgr:
        handle = mgr.save(
            3, {"app": ModelOptimizerState(model, optim, extra={"step": 3})}, metadata={"note": "x"}
        )
        handle.staged.result(timeout=10)
        info = handle.committed.result(timeout=60)
    assert info.step == 3 and info.world_size == 1 and dict(info.metadata) == {"note": "x"}
    # Training goes on after the save; the restore must bring back the saved values.
    train_steps(model, optim, 2)
    model2, optim2 = make_model_and_optimizer(seed=1)
    train_steps(model2, optim2, 1)
    # Non-tensor values load by key, like DCP: the target names the keys it expects.
    extra: dict[str, object] = {"step": 0}
    with CheckpointManager(str(tmp_path)) as mgr:
        loaded = mgr.load({"app": ModelOptimizerState(model2, optim2, extra=extra)})
    assert loaded is not None and loaded.step == 3
    assert extra == {"step": 3}
    assert_bit_identical(expected, flat_state(model2, optim2))


def test_commit_record_lists_every_file_and_latest_points_at_it(tmp_path: Path) -> None:
    model, optim = make_model_and_optimizer()
    with CheckpointManager(str(tmp_path)) as mgr:
        _save_at(mgr, 5, model, optim)
    d = tmp_path / "step-0000000005_r0000"
    record = json.loads((d / "COMMIT.json").read_text())
    on_disk = {p.name for p in d.iterdir()} - {"COMMIT.json"}
    assert set(record["files"]) == on_disk and ".metadata" in on_disk
    assert json.loads((tmp_path / "latest.json").read_text()) == {
        "step": 5,
        "dir": "step-0000000005_r0000",
    }


def test_directory_without_commit_record_is_never_loaded(tmp_path: Path) -> None:
    model, optim = make_model_and_optimizer()
    with CheckpointManager(str(tmp_path)) as mgr:
        _save_at(mgr, 1, model, optim)
        train_steps(model, optim, 1)
        _save_at(mgr, 2, model, optim)
    # Simulate a crash between the last shard and the commit record.
    (tmp_path / "step-0000000002_r0000" / "COMMIT.json").unlink()
    model2, optim2 = make_model_and_optimizer(seed=3)
    with CheckpointManager(str(tmp_path)) as mgr:
        latest = mgr.latest()
        assert latest is not None and latest.step == 1
        info = mgr.load({"app": ModelOptimizerState(model2, optim2)})
        assert info is not None and info.step == 1
        with pytest.raises(
            CheckpointNotFoundError, match=r"^No committed checkpoint at step \(2\)"
        ):
            mgr.load({"app": ModelOptimizerState(model2, optim2)}, step=2)


def test_flipped_byte_in_a_shard_is_detected_and_latest_falls_back(tmp_path: Path) -> None:
    model, optim = make_model_and_optimizer()
    with CheckpointManager(str(tmp_path), keep_last=5) as mgr:
        _save_at(mgr, 1, model, optim)
        good = flat_state(model, optim)
        train_steps(model, optim, 1)
        _save_at(mgr, 2, model, optim)
    _flip_byte_in_a_shard(tmp_path / "step-0000000002_r0000")
    model2, optim2 = make_model_and_optimizer(seed=4)
    with CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(
            CheckpointCorruptError, match=r"^Checkpoint file \(.*\.distcp\) has CRC32"
        ):
            mgr.load({"app": ModelOptimizerState(model2, optim2)}, step=2)
        info = mgr.load({"app": ModelOptimizerState(model2, optim2)})
    assert info is not None and info.step == 1
    assert_bit_identical(good, flat_state(model2, optim2))


def test_stock_dcp_load_reads_our_checkpoint(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(0, {"w": t, "nested": {"b": torch.ones(2, dtype=torch.int64)}}).committed.result(
            60
        )
    out = {"w": torch.zeros(3, 4), "nested": {"b": torch.zeros(2, dtype=torch.int64)}}
    stock_dcp_load(out, checkpoint_id=str(tmp_path / "step-0000000000_r0000"))
    assert torch.equal(out["w"], t) and torch.equal(
        out["nested"]["b"], torch.ones(2, dtype=torch.int64)
    )


def test_retention_keeps_last_n_and_removes_crash_leftovers(tmp_path: Path) -> None:
    leftover = tmp_path / "step-0000000001_r0000"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    with CheckpointManager(str(tmp_path), keep_last=2) as mgr:
        for step in (2, 3, 4, 5):
            mgr.save(step, {"w": torch.full((4,), float(step))})
        last = mgr.wait()
    assert last is not None and last.step == 5
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert names == ["step-0000000004_r0000", "step-0000000005_r0000"]


def test_staging_buffers_are_reused_and_isolated_from_later_updates(tmp_path: Path) -> None:
    w = torch.zeros(4)
    with CheckpointManager(str(tmp_path), keep_last=5) as mgr:
        mgr.save(1, {"w": w}).committed.result(60)
        buf_first = mgr._stager._buffers[("w", (4,), torch.float32)]
        w.add_(1)
        handle = mgr.save(2, {"w": w})
        handle.staged.result(10)
        w.add_(100)  # must not leak into step 2
        handle.committed.result(60)
        assert mgr._stager._buffers[("w", (4,), torch.float32)] is buf_first
        out = {"w": torch.empty(4)}
        mgr.load(out, step=2)
    assert torch.equal(out["w"], torch.ones(4))


def test_empty_root_is_a_fresh_start(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path / "new")) as mgr:
        assert mgr.latest() is None
        assert mgr.load({"w": torch.zeros(1)}) is None


def test_sync_mode_commits_before_save_returns(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), async_mode="disabled") as mgr:
        handle = mgr.save(9, {"w": torch.ones(3)})
        assert handle.committed.done() and handle.committed.result().step == 9


def test_path_that_is_a_file_is_rejected_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(
        CheckpointError, match=r"^Checkpoint URL \(" + re.escape(str(f)) + r"\) is a file"
    ):
        CheckpointManager(str(f))


def test_unknown_url_scheme_is_rejected_naming_it() -> None:
    with pytest.raises(CheckpointError, match=r"^Checkpoint URL \(nosuch://b/p\) has a scheme"):
        CheckpointManager("nosuch://b/p")


def test_checkpoint_of_another_format_version_is_refused_naming_it(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).committed.result(60)
    record = tmp_path / "step-0000000001_r0000" / "COMMIT.json"
    doc = json.loads(record.read_bytes())
    doc["format_version"] = 7
    record.write_text(json.dumps(doc))
    pattern = (
        r"^Commit record \(" + re.escape(str(record)) + r"\) has format version \(7\) but this "
        r"code reads version \(1\); load it with a matching elastic-run release\.$"
    )
    with CheckpointManager(str(tmp_path)) as mgr:
        with pytest.raises(CheckpointFormatError, match=pattern):
            mgr.load({"w": torch.zeros(2)})
        with pytest.raises(CheckpointFormatError, match=pattern):
            mgr.load({"w": torch.zeros(2)}, step=1)
        with pytest.raises(CheckpointFormatError, match=pattern):
            mgr.latest()


def test_bad_async_mode_is_rejected_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^async_mode \('sometimes'\) is not one of"):
        CheckpointManager(str(tmp_path), async_mode="sometimes")


def test_failed_save_is_reported_keeps_previous_checkpoint_and_next_save_works(
    tmp_path: Path,
) -> None:
    # A file where the attempt directory must go makes DCP's writer fail for that step.
    (tmp_path / "step-0000000004_r0000").write_bytes(b"in the way")
    with CheckpointManager(str(tmp_path), keep_last=5) as mgr:
        mgr.save(3, {"w": torch.full((2,), 3.0)}).committed.result(60)
        failed = mgr.save(4, {"w": torch.full((2,), 4.0)})
        pattern = r"^Checkpoint at step \(4\) in \(.*\) was not committed"
        with pytest.raises(CheckpointCommitError, match=pattern):
            failed.committed.result(60)
        latest = mgr.latest()
        assert latest is not None and latest.step == 3
        assert mgr.save(5, {"w": torch.full((2,), 5.0)}).committed.result(60).step == 5
        out = {"w": torch.zeros(2)}
        info = mgr.load(out)
    assert info is not None and info.step == 5 and torch.equal(out["w"], torch.full((2,), 5.0))


def test_at_most_one_save_is_in_flight(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), keep_last=10) as mgr:
        handles = [mgr.save(step, {"w": torch.full((1000,), float(step))}) for step in range(4)]
        # Each save admits only after the previous one resolved.
        for earlier in handles[:-1]:
            assert earlier.committed.done()
        assert [h.committed.result(60).step for h in handles] == [0, 1, 2, 3]
