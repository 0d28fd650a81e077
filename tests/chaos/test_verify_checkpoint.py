"""The in-place campaign's checkpoint verifier, on a real S3 server inside a namespace.

The campaign verifies every run's last checkpoint in its own process, reaching moto's S3
server (reachable only from the run's namespaces) through an asyncio loop started inside the
observer's namespace. Checks: a good checkpoint loads, is the last step and matches the final
weights; a damaged one is reported (the verifier can fail); the verification leaves no thread
of this process in the namespace (the cluster's ``assert_clean``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState
from tests.chaos.netns_chaos import _Storage
from tests.chaos.verify_checkpoint import VERIFY_LIMIT_S, _IoLoop, s3_options, verify_in_namespace
from tests.support.netns import NetnsCluster

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(240)]


def _save(url: str, options: dict[str, Any], weights: Path) -> None:
    """Checkpoints the chaos workers' model at steps 5 and 10; its weights to ``weights``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager = CheckpointManager(url, storage_options=options, async_mode="disabled")
    try:
        for step in (5, 10):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            manager.save(step, {"train": ModelOptimizerState(model, optimizer)})
            manager.wait()
    finally:
        manager.close()
    torch.save(model.state_dict(), weights)


def _damage(url: str, endpoint: str) -> None:
    """Flips one byte of a shard of the newest checkpoint (same size: only its CRC32 can
    tell)."""
    io = _IoLoop()
    try:
        from s3fs import S3FileSystem

        fs = S3FileSystem(**s3_options(endpoint), loop=io.loop, skip_instance_cache=True)
        shard = sorted(fs.glob(f"{url.removeprefix('s3://')}/step-0000000010_*/*.distcp"))[0]
        data = bytearray(fs.cat_file(shard))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(shard, bytes(data))
        del fs
    finally:
        S3FileSystem.clear_instance_cache()
        io.close()


def test_the_verifier_reads_s3_from_the_namespace_and_leaves_nothing_behind(
    netns_cluster_factory: Callable[..., NetnsCluster], tmp_path: Path
) -> None:
    cluster = netns_cluster_factory(nodes=1, etcd_members=0)
    storage = _Storage(cluster, tmp_path / "moto.log")
    try:
        url = f"s3://{storage.bucket}/job"
        weights = tmp_path / "weights.pt"
        io = cluster.observer.call(_IoLoop)
        try:
            cluster.observer.call(_save, url, {**s3_options(storage.endpoint),
                                               "loop": io.loop}, weights)
        finally:
            from s3fs import S3FileSystem

            S3FileSystem.clear_instance_cache()
            io.close()

        started = time.monotonic()
        result = verify_in_namespace(cluster.observer, url, str(weights),
                                     endpoint=storage.endpoint)
        took = time.monotonic() - started
        assert result == {"step": 10, "worst": 0.0}, result
        # Far inside the limit: no interpreter, no torch import (the limit bounds storage
        # outages and a loaded machine; here the reads alone).
        assert took < VERIFY_LIMIT_S / 2, took

        other = tmp_path / "other.pt"
        torch.save({k: v + 1.0 for k, v in torch.load(weights).items()}, other)
        result = verify_in_namespace(cluster.observer, url, str(other),
                                     endpoint=storage.endpoint)
        assert result["worst"] == pytest.approx(1.0), result

        cluster.observer.call(_damage, url, storage.endpoint)
        damaged = verify_in_namespace(cluster.observer, url, str(weights),
                                      endpoint=storage.endpoint)
        assert "CRC32" in damaged.get("error", ""), damaged

        missing = verify_in_namespace(cluster.observer, f"s3://{storage.bucket}/none",
                                      str(weights), endpoint=storage.endpoint)
        assert "no committed checkpoint" in missing.get("error", ""), missing
    finally:
        storage.close()
