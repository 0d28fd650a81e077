"""A worker cut off from its job never commits a checkpoint and never trains on in a stale
world.

The manager asks ``commit_fence`` right before it writes a commit record; the in-place
controller answers from what the node agent told the worker over the real local channel
(its node's lease state, an eviction) and from its own world's abort. A newer world that
leaves the worker itself out (evicted, its node dropped) aborts the world it trains in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointManager
from checkpointing.errors import CheckpointCommitError
from elastic.agent_link import AgentLink
from elastic.contract.messages import (
    Evict,
    Finished,
    Hello,
    Lease,
    Welcome,
    WorkerMessage,
    World,
)
from elastic.contract.records import WorldMember, WorldRecord
from elastic.inplace.abort import WorldAbort
from elastic.inplace.controller import InPlaceController
from launch.channel import ChannelServer, WorkerConnection
from membership.silent_peers import STALL_RULE


def test_a_fenced_commit_writes_no_commit_record_and_the_previous_one_stays_latest(
    tmp_path: Path,
) -> None:
    manager = CheckpointManager(str(tmp_path), async_mode="disabled")
    state = {"w": torch.arange(4.0)}
    fence_open = [True]
    manager.commit_fence = lambda: fence_open[0]
    try:
        assert manager.save(1, state).committed.result().step == 1
        fence_open[0] = False
        refused = manager.save(2, state)
        with pytest.raises(CheckpointCommitError, match=r"step \(2\) was not committed"):
            refused.committed.result()
        committed = sorted(p.parent.name for p in tmp_path.glob("*/COMMIT.json"))
        assert len(committed) == 1 and committed[0].startswith("step-0000000001")
        latest = manager.latest()
        assert latest is not None and latest.step == 1
        fence_open[0] = True  # back in the job: the next save commits again
        assert manager.save(3, state).committed.result().step == 3
    finally:
        manager.close()


class _Agent:
    """The agent's end of a real channel, welcoming one worker."""

    def __init__(self) -> None:
        self.server = ChannelServer(self._on_message, lambda _c: None,
                                    accept=lambda pid: pid == os.getpid())

    def _on_message(self, connection: WorkerConnection, message: WorkerMessage) -> None:
        if isinstance(message, Hello):
            connection.send(Welcome(node="n0", worker="n0/0.1", stall=STALL_RULE))


@pytest.fixture
def controller() -> Iterator[tuple[_Agent, InPlaceController]]:
    agent = _Agent()
    link = AgentLink(agent.server.path, local_rank=0, incarnation=1)
    ctl = InPlaceController(link, backend="gloo", device=torch.device("cpu"),
                            build_timeout=timedelta(seconds=5), train_timeout=None)
    try:
        yield agent, ctl
    finally:
        link.close()
        agent.server.close()


def test_the_controller_fences_commits_while_the_nodes_lease_is_not_fresh(
    controller: tuple[_Agent, InPlaceController],
) -> None:
    agent, ctl = controller
    assert ctl.may_commit()
    agent.server.broadcast(Lease(False))  # etcd unreachable
    assert ctl.link.wait(lambda link: not link.lease_ok, 5.0)
    assert not ctl.may_commit()
    agent.server.broadcast(Lease(True))
    assert ctl.link.wait(lambda link: link.lease_ok, 5.0)
    assert ctl.may_commit()


def test_the_controller_fences_commits_once_evicted_or_its_world_aborted(
    controller: tuple[_Agent, InPlaceController],
) -> None:
    agent, ctl = controller
    guard = WorldAbort(name="epoch 1")
    ctl._guard = guard
    assert ctl.may_commit()
    guard.abort("member(s) n1/0.1 are gone")
    assert not ctl.may_commit()
    ctl._guard = WorldAbort(name="epoch 2")  # the next world, built
    assert ctl.may_commit()
    agent.server.broadcast(Evict("held the step back"))
    assert ctl.link.wait(lambda link: link.evicted is not None, 5.0)
    assert not ctl.may_commit()


def _world(epoch: int, *members: tuple[str, str], departed: tuple[str, ...] = ()
           ) -> WorldRecord:
    return WorldRecord(epoch, tuple(WorldMember(node, "10.0.0.1", (local,), 1)
                                    for node, local in members),
                       ("10.0.0.1", 1), "inplace", departed=departed)


def _tell(agent: _Agent, ctl: InPlaceController, world: WorldRecord) -> None:
    agent.server.broadcast(World(world))
    assert ctl.link.wait(lambda link: link.world is not None
                         and link.world.epoch == world.epoch, 5.0)
    time.sleep(0.1)  # the listener runs right after the world is applied


def test_a_newer_world_that_leaves_the_worker_out_aborts_its_stale_world(
    controller: tuple[_Agent, InPlaceController],
) -> None:
    agent, ctl = controller
    ctl.world = _world(1, ("n0", "0.1"), ("n1", "0.1"))
    ctl._guard = guard = WorldAbort(name="epoch 1")
    _tell(agent, ctl, _world(2, ("n0", "0.1"), ("n1", "0.1"), ("n2", "0.1")))  # growth
    assert not guard.aborted
    _tell(agent, ctl, _world(3, ("n1", "0.1"), ("n2", "0.1")))  # n0 dropped or evicted
    assert guard.aborted and guard.reason == "this worker is not in world epoch 3"
    assert not ctl.may_commit()


def test_a_departing_worker_left_out_of_the_next_world_is_not_aborted(
    controller: tuple[_Agent, InPlaceController],
) -> None:
    agent, ctl = controller
    ctl.world = _world(1, ("n0", "0.1"), ("n1", "0.1"))
    ctl._guard = guard = WorldAbort(name="epoch 1")
    _tell(agent, ctl, _world(2, ("n1", "0.1"), departed=("n0/0.1",)))
    assert not guard.aborted  # a planned change: it leaves at a step boundary


class _Recorder(_Agent):
    """An agent end that also keeps what the worker sent."""

    def __init__(self) -> None:
        self.received: list[WorkerMessage] = []
        super().__init__()

    def _on_message(self, connection: WorkerConnection, message: WorkerMessage) -> None:
        self.received.append(message)
        super()._on_message(connection, message)


def _finishing_rank0(agent: _Agent) -> tuple[AgentLink, InPlaceController]:
    link = AgentLink(agent.server.path, local_rank=0, incarnation=1)
    ctl = InPlaceController(link, backend="gloo", device=torch.device("cpu"),
                            build_timeout=timedelta(seconds=5), train_timeout=None)
    assert link.wait(lambda lk: lk.me == "n0/0.1", 5.0)
    ctl.world = _world(3, ("n0", "0.1"))  # a world of one: it trains on while cut off
    return link, ctl


def test_a_rank_zero_cut_off_from_etcd_does_not_end_the_job_when_it_finishes() -> None:
    # Its final checkpoint was fenced off: ending the job now would end it without one. It
    # exits as a failure of the partition instead, and the job finishes the steps again.
    agent = _Recorder()
    link, ctl = _finishing_rank0(agent)
    try:
        agent.server.broadcast(Lease(False))
        assert link.wait(lambda lk: not lk.lease_ok, 5.0)
        with pytest.raises(SystemExit) as exited:
            ctl.finish(60, finished=True)
        assert exited.value.code == 1
        time.sleep(0.2)
        assert not [m for m in agent.received if isinstance(m, Finished)]
    finally:
        link.close()
        agent.server.close()


def test_a_rank_zero_in_the_jobs_world_ends_the_job_when_it_finishes() -> None:
    agent = _Recorder()
    link, ctl = _finishing_rank0(agent)
    try:
        ctl.finish(60, finished=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not [
                m for m in agent.received if isinstance(m, Finished)]:
            time.sleep(0.05)
        assert [m.step for m in agent.received if isinstance(m, Finished)] == [60]
    finally:
        link.close()
        agent.server.close()
