"""NodeAgent's restart accounting, environment and exit barrier, with torch's hooks stubbed."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from launch.agent import NodeAgent


class FakeHandler(RendezvousHandler):
    def __init__(self) -> None:
        self.lost: set[str] = set()
        self.round = 4

    def get_backend(self) -> str:
        return "fake"

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        raise NotImplementedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "job-7"

    def shutdown(self) -> bool:
        return True

    def lost_members(self) -> set[str]:
        return set(self.lost)


FAILED = RunResult(
    state=WorkerState.FAILED,
    failures={0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="/nonexistent")},
)


@pytest.fixture
def handler() -> FakeHandler:
    return FakeHandler()


@pytest.fixture
def restarts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record torch-level restarts instead of stopping and starting processes."""
    calls: list[int] = []

    def fake_restart(self: SimpleElasticAgent, worker_group: Any) -> None:
        calls.append(1)
        worker_group.group_world_size = getattr(self, "next_world", worker_group.group_world_size)
        worker_group.state = WorkerState.HEALTHY

    monkeypatch.setattr(SimpleElasticAgent, "_restart_workers", fake_restart)
    return calls


def _agent(handler: FakeHandler, *, max_restarts: int, settle: float = 0.3) -> NodeAgent:
    spec = WorkerSpec(role="w", local_world_size=1, rdzv_handler=handler, entrypoint="true",
                      max_restarts=max_restarts)
    agent = NodeAgent(spec, DefaultLogsSpecs(), failure_settle_timeout=settle,
                      exit_barrier_timeout=1.0)
    agent._worker_group.group_world_size = 3
    return agent


def _monitor_returns(monkeypatch: pytest.MonkeyPatch, result: RunResult) -> None:
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, wg: result)


def test_failure_with_a_lost_member_restarts_without_charging(
    handler: FakeHandler, restarts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _agent(handler, max_restarts=0)
    _monitor_returns(monkeypatch, FAILED)
    handler.lost = {"node-c"}
    result = agent._monitor_workers(agent._worker_group)
    assert result.state == WorkerState.HEALTHY
    assert restarts == [1]
    assert agent.remaining_restarts == 0
    assert agent.membership_restarts == 1


def test_failure_without_evidence_is_charged_at_once_when_restarts_remain(
    handler: FakeHandler, restarts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _agent(handler, max_restarts=2)
    _monitor_returns(monkeypatch, FAILED)
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.FAILED
    assert restarts == []


def test_failure_with_no_restarts_left_waits_for_evidence_then_fails(
    handler: FakeHandler, restarts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _agent(handler, max_restarts=0, settle=0.3)
    _monitor_returns(monkeypatch, FAILED)
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.HEALTHY
    time.sleep(0.35)
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.FAILED
    assert restarts == []


def test_failure_held_for_settling_becomes_membership_change_when_a_node_is_lost(
    handler: FakeHandler, restarts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _agent(handler, max_restarts=0, settle=30)
    _monitor_returns(monkeypatch, FAILED)
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.HEALTHY
    handler.lost = {"node-b"}
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.HEALTHY
    assert restarts == [1]
    assert agent.membership_restarts == 1


def test_charged_restart_is_refunded_when_the_new_round_is_smaller(
    handler: FakeHandler, restarts: list[int]
) -> None:
    agent = _agent(handler, max_restarts=1)
    agent._remaining_restarts = 0  # torch charged the failure before calling _restart_workers
    agent._worker_group.state = WorkerState.FAILED
    agent.next_world = 2  # type: ignore[attr-defined]
    agent._restart_workers(agent._worker_group)
    assert agent.remaining_restarts == 1
    assert agent.membership_restarts == 1


def test_charged_restart_stays_charged_when_membership_is_unchanged(
    handler: FakeHandler, restarts: list[int]
) -> None:
    agent = _agent(handler, max_restarts=1)
    agent._remaining_restarts = 0
    agent._worker_group.state = WorkerState.FAILED
    agent._restart_workers(agent._worker_group)
    assert agent.remaining_restarts == 0
    assert agent.membership_restarts == 0


def test_workers_get_round_run_id_and_agent_pid(
    handler: FakeHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, str] = {}

    def fake_start(self: LocalElasticAgent, worker_group: Any) -> dict[int, Any]:
        seen.update({k: v for k, v in os.environ.items() if k.startswith("ELASTIC_")})
        return {0: 123}

    monkeypatch.setattr(LocalElasticAgent, "_start_workers", fake_start)
    for name in ("ELASTIC_ROUND", "ELASTIC_RUN_ID", "ELASTIC_AGENT_PID", "ELASTIC_ETCD_ENDPOINTS"):
        monkeypatch.delenv(name, raising=False)
    spec = WorkerSpec(role="w", local_world_size=1, rdzv_handler=handler, entrypoint="true")
    agent = NodeAgent(spec, DefaultLogsSpecs(), etcd_endpoints="127.0.0.1:2379")
    agent._start_workers(agent._worker_group)
    assert seen["ELASTIC_ROUND"] == "4"
    assert seen["ELASTIC_RUN_ID"] == "job-7"
    assert seen["ELASTIC_AGENT_PID"] == str(os.getpid())
    assert seen["ELASTIC_ETCD_ENDPOINTS"] == "127.0.0.1:2379"


@pytest.fixture
def store() -> Iterator[HashStore]:
    yield HashStore()


def test_exit_barrier_does_not_wait_for_a_lost_member(
    handler: FakeHandler, store: HashStore, caplog: pytest.LogCaptureFixture
) -> None:
    agent = _agent(handler, max_restarts=0)
    agent._exit_barrier_timeout = 60
    agent._store = store
    agent._worker_group.group_world_size = 3
    store.add("elastic/exit_barrier/arrived", 1)  # one peer already finished
    handler.lost = {"node-c"}  # the third is dead
    caplog.set_level("INFO", logger="launch.agent")
    agent._exit_barrier()
    assert "Exit barrier done: 2 arrived, 1 lost, world 3." in caplog.text
    assert "timed out" not in caplog.text


def test_exit_barrier_waits_for_a_live_member_until_its_timeout(
    handler: FakeHandler, store: HashStore, caplog: pytest.LogCaptureFixture
) -> None:
    agent = _agent(handler, max_restarts=0)
    agent._exit_barrier_timeout = 0.5
    agent._store = store
    agent._worker_group.group_world_size = 2
    caplog.set_level("INFO", logger="launch.agent")
    agent._exit_barrier()
    assert "Exit barrier timed out after 0 s (1 of 2 arrived, 0 lost)." in caplog.text
