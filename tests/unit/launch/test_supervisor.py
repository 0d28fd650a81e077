"""The supervisor's heartbeat rule on real processes: a frozen (SIGSTOPped) worker is replaced
within a second; a worker whose heartbeat is late but which runs (a GC pause holding the GIL,
a long step) keeps its process until the lease TTL.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from elastic.eventlog import EventLog
from launch.agent_config import AgentConfig
from launch.channel import WorkerConnection
from launch.slots import SlotProcess, WorkerCommand
from launch.supervisor import FROZEN_AFTER_S, Supervisor

TTL = 3.0


@pytest.fixture
def supervisor(tmp_path: object) -> Iterator[Supervisor]:
    config = AgentConfig(job_id="j", key_prefix="/e", min_nodes=1, max_nodes=1,
                         nproc_per_node=2, addr="127.0.0.1", ttl=int(TTL))
    command = WorkerCommand((sys.executable, "-c", "import time; time.sleep(60)"),
                            dict(os.environ))
    made = Supervisor(config, command, EventLog(None, job="j", source="test"),
                      node=lambda: "n0", channel_path=lambda: "/nonexistent",
                      may_start=lambda: True)
    try:
        yield made
    finally:
        made.kill_all()


def _connection(slot_rank: int, pid: int, silent_for: float) -> WorkerConnection:
    ours, _theirs = socket.socketpair()
    connection = WorkerConnection(slot_rank, 1, pid, ours)
    connection.last_heard = time.monotonic() - silent_for
    return connection


def _started(supervisor: Supervisor, rank: int) -> SlotProcess:
    slot = supervisor.slots[rank]
    slot.incarnation = 1
    supervisor.start(slot, None, None)
    assert slot.process is not None
    return slot.process


def test_a_stopped_worker_is_replaced_once_silent_past_the_frozen_threshold(
    supervisor: Supervisor,
) -> None:
    frozen = _started(supervisor, 0)
    os.kill(frozen.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not frozen.stopped() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert frozen.stopped()
    # Silent, but not for long enough yet: a stop shorter than the threshold is forgiven.
    supervisor.check_heartbeats([_connection(0, frozen.pid, FROZEN_AFTER_S / 2)], TTL)
    assert frozen.exit_code() is None
    supervisor.check_heartbeats([_connection(0, frozen.pid, FROZEN_AFTER_S + 0.1)], TTL)
    assert frozen.proc.wait(5) == -signal.SIGKILL


def test_a_running_worker_with_a_late_heartbeat_keeps_its_process_until_the_ttl(
    supervisor: Supervisor,
) -> None:
    busy = _started(supervisor, 1)  # running or sleeping: never stopped
    assert not busy.stopped()
    supervisor.check_heartbeats([_connection(1, busy.pid, TTL - 0.5)], TTL)
    time.sleep(0.2)
    assert busy.exit_code() is None, "a worker that only missed heartbeats was replaced"
    supervisor.check_heartbeats([_connection(1, busy.pid, TTL + 0.5)], TTL)
    assert busy.proc.wait(5) == -signal.SIGKILL


@pytest.mark.parametrize("in_place", [False, True], ids=["auto", "on"])
def test_auto_drops_the_warm_standbys_once_the_workers_reconfigure_in_place(
    in_place: bool,
) -> None:
    """``--warm-standby auto`` keeps a standby per slot while the workers restart, and kills
    them once a worker declared that it reconfigures in place; ``on`` keeps them."""
    config = AgentConfig(job_id="j", key_prefix="/e", min_nodes=1, max_nodes=1,
                         nproc_per_node=1, addr="127.0.0.1", ttl=int(TTL), warm_standby=True,
                         standby_in_place=in_place)
    command = WorkerCommand((sys.executable, "-u", "-m", "launch.worker_guard", "train.py"),
                            dict(os.environ))
    made = Supervisor(config, command, EventLog(None, job="j", source="test"),
                      node=lambda: "n0", channel_path=lambda: "/nonexistent",
                      may_start=lambda: True)
    try:
        assert made.standby is not None
        made.tick_standbys()
        (pid,) = made.standby.pids()
        assert os.path.exists(f"/proc/{pid}")
        made.tick_standbys()
        assert made.standby is not None, "dropped while no worker had declared in place"
        made.slots[0].inplace = True  # what a worker's Declare(inplace=True) sets
        made.tick_standbys()
        if in_place:
            assert made.standby is not None and made.standby.pids() == [pid]
        else:
            assert made.standby is None
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not os.path.exists(f"/proc/{pid}"), "the dropped standby still runs"
    finally:
        if made.standby is not None:
            made.standby.close()
        made.kill_all()
