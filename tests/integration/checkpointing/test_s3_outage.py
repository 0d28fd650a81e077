"""An S3 outage during a save, injected by a TCP fault proxy in front of a live moto server.

s3fs talks real HTTP to moto through :class:`~tests.support.fault_proxy.FaultProxy`. The
outages start before ``save()`` and end only when the test heals them, so the ordering
"``save()`` returned while the storage was still down" is a fact, not a timing guess: the
training thread was blocked only for the staging copy, never by the outage.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import s3fs
import torch
from moto.server import ThreadedMotoServer

from checkpointing import CheckpointManager
from checkpointing.errors import CheckpointCommitError
from tests.support.fault_proxy import FaultProxy

pytestmark = pytest.mark.s3

#: Storage retry deadlines: the short outage is healed right after the first retry, far
#: inside the long one; the long outage outlasts the short one.
_LONG_DEADLINE = timedelta(seconds=20)
_SHORT_DEADLINE = timedelta(seconds=3)
#: botocore waits, so a blackholed request gives up well inside the deadline.
_CONFIG = {"connect_timeout": 1, "read_timeout": 2}


@pytest.fixture(scope="module")
def moto() -> Iterator[tuple[str, int]]:
    saved = {
        k: os.environ.get(k)
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1"
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield host, int(port)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def proxy(moto: tuple[str, int]) -> Iterator[FaultProxy]:
    with FaultProxy(*moto) as p:
        yield p


@pytest.fixture
def url(moto: tuple[str, int]) -> str:
    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    direct = {"client_kwargs": {"endpoint_url": f"http://{moto[0]}:{moto[1]}"}}
    s3fs.S3FileSystem(key="x", secret="x", **direct).mkdir(bucket)
    return f"s3://{bucket}/run"


def _options(proxy: FaultProxy) -> dict[str, Any]:
    return {
        "client_kwargs": {"endpoint_url": proxy.endpoint},
        "key": "x",
        "secret": "x",
        "config_kwargs": dict(_CONFIG),
    }


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(512, 1024, generator=g),  # 2 MiB
        "exp_avg": torch.randn(512, 1024, generator=g),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def _wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` until it holds; ``False`` if ``timeout`` seconds pass first."""
    pause = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return True
        pause.wait(0.02)
    return condition()


def _load(mgr: CheckpointManager, step: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    info = mgr.load(out, step=step)
    assert info is not None
    return info.step, out


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_outage_shorter_than_the_deadline_is_retried_and_the_save_commits(
    proxy: FaultProxy, url: str
) -> None:
    opts = _options(proxy)
    with CheckpointManager(url, storage_options=opts, retry_deadline=_LONG_DEADLINE) as mgr:
        mgr.save(1, _state(1)).committed.result(60)
        mgr.wait()  # retention too: nothing of step 1 is left on the wire
        retries_before = mgr.storage.retries
        proxy.reset()  # connections refused (reset) until heal()
        want = _state(2)
        handle = mgr.save(2, want)
        # save() came back after staging, while the storage was still unreachable.
        assert proxy.in_outage() and handle.staged.done() and not handle.committed.done()
        assert proxy.wait_for_fault(timeout=30), "the save never reached the storage"
        # Heal only once our retry policy (not a retry inside aiohttp) has met the outage.
        assert _wait_for(lambda: mgr.storage.retries > retries_before, timeout=30)
        assert proxy.in_outage() and not handle.committed.done()
        proxy.heal()
        info = handle.committed.result(60)
        assert info.step == 2
        assert mgr.latest() is not None and mgr.latest().step == 2  # type: ignore[union-attr]
        step, got = _load(mgr)
    assert step == 2
    _assert_identical(want, got)


def test_outage_longer_than_the_deadline_fails_the_save_and_keeps_the_last_good_one(
    proxy: FaultProxy, url: str
) -> None:
    opts = _options(proxy)
    with CheckpointManager(url, storage_options=opts, retry_deadline=_SHORT_DEADLINE) as mgr:
        good = _state(1)
        mgr.save(1, good).committed.result(60)
        mgr.wait()
        proxy.blackhole()  # requests accepted and never answered until heal()
        handle = mgr.save(2, _state(2))
        assert proxy.in_outage() and handle.staged.done() and not handle.committed.done()
        assert proxy.wait_for_fault(timeout=30), "the save never reached the storage"
        exc = handle.committed.exception(timeout=120)
        # It failed on its own deadline while the outage was still going on.
        assert proxy.in_outage()
        assert isinstance(exc, CheckpointCommitError)
        message = str(exc)
        assert message.startswith(f"Checkpoint at step (2) in ({url}) was not committed after")
        assert "the previous checkpoint stays valid" in message and "\n" not in message
        proxy.heal()
        latest = mgr.latest()
        assert latest is not None and latest.step == 1
        step, got = _load(mgr)
        assert step == 1
        _assert_identical(good, got)
        # The next save tries again and commits once the storage is back.
        third = _state(3)
        assert mgr.save(3, third).committed.result(60).step == 3
        step, got = _load(mgr)
    assert step == 3
    _assert_identical(third, got)
