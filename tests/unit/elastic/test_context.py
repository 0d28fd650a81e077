"""elastic.init() on a real gloo world of one process."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import elastic
from elastic.context import World
from elastic.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_init_builds_a_training_group_and_a_separate_checkpoint_group_and_close_destroys_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "ELASTIC_ROUND": "3", "ELASTIC_RUN_ID": "job-1"}.items():
        monkeypatch.setenv(name, value)
    ctx = elastic.init(train_timeout=timedelta(seconds=5))
    try:
        assert (ctx.rank, ctx.world_size, ctx.round, ctx.world.run_id) == (0, 1, 3, "job-1")
        assert ctx.is_leader and ctx.device == torch.device("cpu") and ctx.backend == "gloo"
        assert ctx.checkpoint_group is not ctx.process_group
        tensor = torch.ones(2)
        dist.all_reduce(tensor, group=ctx.checkpoint_group)
        ctx.after_first_step()  # lowers the timeout after a barrier
        assert torch.equal(tensor, torch.ones(2))
    finally:
        ctx.close()
    assert not dist.is_initialized()
    ctx.close()  # idempotent


def test_a_rank_outside_the_world_in_the_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^rank \(2\) must be in \[0, world size \(2\)\)"):
        World.from_env()


def test_a_non_numeric_environment_variable_is_named_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match=r"^environment variable WORLD_SIZE \('two'\)"):
        World.from_env()


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^backend \('mpi'\) must be"):
        elastic.init("mpi")


def test_the_package_import_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, elastic; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
