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
from pathlib import Path
from typing import Any

import pytest

from elastic.eventlog import EventLog
from launch.agent_config import AgentConfig
from launch.channel import WorkerConnection
from launch.slots import SlotProcess, WorkerCommand
from launch.supervisor import FROZEN_AFTER_S, STANDBY_HOLD_AFTER_HELLO_S, Supervisor

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


def _with_standbys(script: str, **settings: Any) -> Supervisor:
    """A one-slot supervisor that keeps warm standbys, its workers running ``script``."""
    config = AgentConfig(job_id="j", key_prefix="/e", min_nodes=1, max_nodes=1,
                         nproc_per_node=1, addr="127.0.0.1", ttl=int(TTL), warm_standby=True,
                         **settings)
    command = WorkerCommand((sys.executable, "-u", "-m", "launch.worker_guard", script),
                            dict(os.environ))
    return Supervisor(config, command, EventLog(None, job="j", source="test"),
                      node=lambda: "n0", channel_path=lambda: "/nonexistent",
                      may_start=lambda: True)


@pytest.mark.parametrize("in_place", [False, True], ids=["auto", "on"])
def test_auto_drops_the_warm_standbys_once_the_workers_reconfigure_in_place(
    in_place: bool,
) -> None:
    """``--warm-standby auto`` keeps a standby per slot while the workers restart, and kills
    them once a worker declared that it reconfigures in place; ``on`` keeps them."""
    made = _with_standbys("train.py", standby_in_place=in_place)
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


@pytest.mark.parametrize("mode", ["auto", "restart"])
def test_a_slots_next_standby_waits_while_a_worker_that_said_hello_may_declare_in_place(
    tmp_path: Path, mode: str,
) -> None:
    """After a hand-over, the slot's next standby does not start for
    ``STANDBY_HOLD_AFTER_HELLO_S`` after its worker's hello, unless the worker declared in
    place first (which drops the standbys: a refill meanwhile imports torch for nothing).
    Under ``--elastic-mode restart`` nothing reconfigures in place and nothing is held."""
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(60)\n")
    made = _with_standbys(str(script), mode=mode)
    try:
        assert made.standby is not None
        made.standby._refill_delay = 0.0  # the hold alone decides here
        made.tick_standbys()
        (first,) = made.standby.pids()
        worker = _started(made, 0)
        assert worker.pid == first and made.standby.handed_over == 1
        made.standby._due[0] = 0.0  # whether the standby had finished importing or not
        slot = made.slots[0]
        slot.connected, slot.connected_at = True, time.monotonic()  # its hello
        made.tick_standbys()
        if mode == "restart":
            assert len(made.standby.pids()) == 1
            return
        assert made.standby.pids() == [], "refilled while the worker may declare in place"
        slot.connected_at = time.monotonic() - STANDBY_HOLD_AFTER_HELLO_S - 0.1
        made.tick_standbys()
        (refilled,) = made.standby.pids()
        assert refilled != first
    finally:
        if made.standby is not None:
            made.standby.close()
        made.kill_all()


def test_a_standby_handed_over_while_importing_is_refilled_later() -> None:
    """The slot's next standby is due ``refill_delay`` after handing over a ready standby,
    and ``REFILL_AFTER_IMPORTING_S`` after one still importing (its worker says hello only
    once its imports are done)."""
    from launch.standby import DEFAULT_REFILL_DELAY_S, REFILL_AFTER_IMPORTING_S, StandbyPool

    assert REFILL_AFTER_IMPORTING_S > DEFAULT_REFILL_DELAY_S
    pool = StandbyPool(sys.executable, 1, lambda _rank: dict(os.environ))
    try:
        pool.tick()
        argv = (sys.executable, "-u", "-m", "launch.worker_guard", "-c", "pass")
        before = time.monotonic()
        proc = pool.take(0, dict(os.environ), argv)  # at once: the standby still imports
        assert proc is not None
        assert pool._due[0] - before >= REFILL_AFTER_IMPORTING_S - 0.5
        proc.kill()
    finally:
        pool.close()
