from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import s3fs
import torch

from checkpointing import CheckpointManager, ModelOptimizerState
from checkpointing.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from tests.integration.checkpointing.conftest import (
    assert_bit_identical,
    flat_state,
    make_model_and_optimizer,
    train_steps,
)
from tests.support.moto_s3 import moto_s3, s3_options

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


_options = s3_options


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**_options(endpoint))
    fs.mkdir(name)
    return name


def test_s3_round_trip_is_bit_identical_and_flipped_byte_falls_back(
    endpoint: str, bucket: str
) -> None:
    opts = _options(endpoint)
    url = f"s3://{bucket}/run1"
    model, optim = make_model_and_optimizer()
    train_steps(model, optim, 2)
    with CheckpointManager(url, storage_options=opts, keep_last=2) as mgr:
        mgr.save(2, {"app": ModelOptimizerState(model, optim)}).committed.result(60)
        good = flat_state(model, optim)
        train_steps(model, optim, 1)
        mgr.save(3, {"app": ModelOptimizerState(model, optim)}).committed.result(60)
    fs = s3fs.S3FileSystem(**opts)
    d = f"{bucket}/run1/step-0000000003_r0000"
    assert fs.exists(f"{d}/COMMIT.json") and fs.exists(f"{bucket}/run1/latest.json")
    shard = sorted(p for p in fs.ls(d) if p.endswith(".distcp"))[0]
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    model2, optim2 = make_model_and_optimizer(seed=5)
    with CheckpointManager(url, storage_options=opts) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"^Checkpoint file \(s3://.*\) has CRC32"):
            mgr.load({"app": ModelOptimizerState(model2, optim2)}, step=3)
        info = mgr.load({"app": ModelOptimizerState(model2, optim2)})
    assert info is not None and info.step == 2
    assert_bit_identical(good, flat_state(model2, optim2))


@pytest.mark.slow
def test_s3_multipart_sized_shard_round_trips(endpoint: str, bucket: str) -> None:
    opts = _options(endpoint)
    big = torch.randn(36 * 1024 * 1024 // 4 * 3)  # ~108 MiB: above s3fs's multipart threshold
    with CheckpointManager(f"s3://{bucket}/big", storage_options=opts) as mgr:
        mgr.save(1, {"big": big}).committed.result(120)
        out = {"big": torch.empty_like(big)}
        mgr.load(out)
    assert torch.equal(out["big"], big)


def test_missing_bucket_is_reported_naming_it(endpoint: str) -> None:
    with pytest.raises(
        CheckpointNotFoundError, match=r"^Bucket \(no-such-bucket-zz\) of checkpoint URL"
    ):
        CheckpointManager("s3://no-such-bucket-zz/p", storage_options=_options(endpoint))


def test_missing_credentials_are_reported_naming_the_url(
    endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    pattern = r"^Storage credentials for \(" + re.escape("s3://b1/p") + r"\) are missing"
    with pytest.raises(CheckpointError, match=pattern):
        CheckpointManager("s3://b1/p", storage_options=opts)


def test_prefix_that_is_an_object_is_rejected_naming_it(endpoint: str, bucket: str) -> None:
    s3fs.S3FileSystem(**_options(endpoint)).pipe_file(f"{bucket}/blob", b"x")
    url = f"s3://{bucket}/blob"
    pattern = r"^Checkpoint URL \(" + re.escape(url) + r"\) is a file"
    with pytest.raises(CheckpointError, match=pattern):
        CheckpointManager(url, storage_options=_options(endpoint))


def test_s3_saves_reuse_upload_buffers_without_leaking_stale_bytes(
    endpoint: str, bucket: str
) -> None:
    # Each save assembles its files in the buffers the previous save filled, which keep their
    # length: a smaller state after a larger one must read back exactly, with none of the
    # older bytes behind it, and the memory must stay with the pool (not be faulted in anew).
    opts = _options(endpoint)
    url = f"s3://{bucket}/reuse"
    gen = torch.Generator().manual_seed(7)
    states = [
        {f"t{i}": torch.randn(2 * 1024 * 1024, generator=gen) for i in range(6)},  # 48 MiB
        {f"t{i}": torch.randn(256 * 1024, generator=gen) for i in range(6)},  # 6 MiB
        {f"t{i}": torch.randn(1024 * 1024, generator=gen) for i in range(6)},  # 24 MiB
    ]
    with CheckpointManager(url, storage_options=opts, keep_last=3) as mgr:
        for step, state in enumerate(states, start=1):
            mgr.save(step, state).committed.result(120)
            assert mgr._upload_buffers.retained_bytes >= 48 * 1024 * 1024
        for step, state in enumerate(states, start=1):
            out = {k: torch.empty_like(v) for k, v in state.items()}
            info = mgr.load(out, step=step)
            assert info is not None and info.step == step
            for k, v in state.items():
                assert torch.equal(out[k], v), (step, k)
    fs = s3fs.S3FileSystem(**opts)
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/reuse/step-0000000003_r0000"))
    # .metadata was put once under its own name: no temporary left behind, no copy made.
    assert ".metadata" in names and not any(n.endswith(".tmp") for n in names)
