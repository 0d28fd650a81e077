"""The worker's world from the launcher's environment, and the drain request on one rank."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from elastic.integrations._drain import DrainAgreement
from elastic.integrations._world import agree, world_from_env
from elastic_errors import ConfigError


def test_a_script_started_alone_is_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ELASTIC_ROUND"):
        monkeypatch.delenv(name, raising=False)
    world = world_from_env()
    assert (world.rank, world.world_size, world.local_world_size, world.launched,
            world.round) == (0, 1, 1, False, None)
    assert agree({"step": 3}) == {"step": 3}  # no process group: its own value


def test_the_launchers_variables_are_read_and_bad_ones_named(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("ELASTIC_ROUND", "7")
    world = world_from_env()
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size,
            world.launched, world.round) == (4, 6, 1, 2, True, 7)
    monkeypatch.setenv("RANK", "six")
    with pytest.raises(ConfigError, match=r"RANK \('six'\) must be an integer"):
        world_from_env()
    monkeypatch.setenv("RANK", "6")
    with pytest.raises(ConfigError, match=r"RANK \(6\) and LOCAL_RANK \(1\) must be below"):
        world_from_env()


def test_sigterm_becomes_a_drain_once_installed_and_the_handler_is_given_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    drain = DrainAgreement(torch.device("cpu"))
    assert drain.at_step_end(1) is False
    drain.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert drain.requested
        assert drain.at_step_end(2) is True  # a world of one agrees with itself at once
        assert drain.at_step_end(3) is True
    finally:
        drain.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    drain.settle()  # nothing in flight: a no-op
