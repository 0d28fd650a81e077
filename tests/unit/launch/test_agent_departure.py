"""Planned departures: the departing agent's sequence and how the peers classify it.

torch's worker processes are replaced by real ``python`` children (really signalled, really
killed) behind a minimal process context; the rendezvous handler is a fake that records calls.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastic.errors import ConfigError
from elastic.eventlog import EventLog, read_events
from launch import cli
from launch.departure import DepartureWatchdog, PlannedDeparture, drain_budget, drain_workers
from launch.preemption import PreemptionNotice
from launch.runner import _without_sigterm
from tests.unit.launch.test_agent import FAILED, FakeHandler, _agent, restarts  # noqa: F401

# Exits 143 a moment after SIGTERM, like a draining ElasticLoop worker.
DRAINS = ("import signal, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.2), sys.exit(143)))\n"
          "print('ready', flush=True)\n"
          "time.sleep(60)\n")
IGNORES = ("import signal, time\n"
           "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "print('ready', flush=True)\n"
           "time.sleep(60)\n")


class _Handler:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc


class FakeContext:
    """The part of torch's SubprocessContext the departure uses."""

    def __init__(self, scripts: list[str]) -> None:
        self.subprocess_handlers = {}
        for rank, script in enumerate(scripts):
            proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                    text=True, start_new_session=True)
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            self.subprocess_handlers[rank] = _Handler(proc)
        self.closed_with: list[int] = []

    def pids(self) -> dict[int, int]:
        return {r: h.proc.pid for r, h in self.subprocess_handlers.items()}

    def close(self, death_sig: int, timeout: float) -> None:
        self.closed_with.append(int(death_sig))
        for h in self.subprocess_handlers.values():
            if h.proc.poll() is None:
                h.proc.send_signal(death_sig)
                h.proc.wait(timeout)

    def stop(self) -> None:
        for h in self.subprocess_handlers.values():
            if h.proc.poll() is None:
                h.proc.kill()
            h.proc.wait(10)
            if h.proc.stdout is not None:
                h.proc.stdout.close()


@pytest.fixture
def contexts() -> Iterator[list[FakeContext]]:
    made: list[FakeContext] = []
    yield made
    for ctx in made:
        ctx.stop()


def _context(contexts: list[FakeContext], *scripts: str) -> FakeContext:
    ctx = FakeContext(list(scripts))
    contexts.append(ctx)
    return ctx


def _notice(in_s: float | None) -> PreemptionNotice:
    deadline = None if in_s is None else datetime.now(timezone.utc) + timedelta(seconds=in_s)
    return PreemptionNotice(source="aws", deadline=deadline, detail="{}")


class DepartingHandler(FakeHandler):
    """A handler that records the departure calls (and can fail them)."""

    def __init__(self) -> None:
        super().__init__()
        self.departing: set[int] = set()
        self.calls: list[str] = []
        self.fail_announce = False
        self.member_ttl = 30

    def departing_members(self) -> set[int]:
        return set(self.departing)

    def announce_departure(self, note: Any) -> bool:
        self.calls.append(f"announce {note['source']}")
        if self.fail_announce:
            raise RuntimeError("etcd is gone")
        return True

    def leave(self, timeout: timedelta, *, lease_only: bool = False) -> None:
        self.calls.append("leave lease" if lease_only else "leave")


# -- budget and drain ---------------------------------------------------------------------


def test_the_drain_budget_fits_the_deadline_and_keeps_time_to_leave() -> None:
    reserve, cap = timedelta(seconds=5), timedelta(seconds=60)
    assert drain_budget(_notice(None), drain_timeout=cap, leave_reserve=reserve) == 60
    assert drain_budget(_notice(120), drain_timeout=cap, leave_reserve=reserve) == 60
    assert 24 < drain_budget(_notice(30), drain_timeout=cap, leave_reserve=reserve) <= 25
    assert drain_budget(_notice(3), drain_timeout=cap, leave_reserve=reserve) == 0
    assert drain_budget(_notice(-10), drain_timeout=cap, leave_reserve=reserve) == 0


def test_draining_workers_stop_by_themselves_within_the_budget(
    contexts: list[FakeContext],
) -> None:
    ctx = _context(contexts, DRAINS, DRAINS)
    codes, drained = drain_workers(ctx, 10.0)
    assert drained and codes == {0: 143, 1: 143}
    assert ctx.closed_with == []


def test_workers_that_ignore_sigterm_are_killed_when_the_budget_ends(
    contexts: list[FakeContext],
) -> None:
    ctx = _context(contexts, DRAINS, IGNORES)
    codes, drained = drain_workers(ctx, 0.5)
    assert not drained and codes == {0: 143, 1: -9}
    assert ctx.closed_with == [9]


def test_no_workers_is_an_instant_drain() -> None:
    assert drain_workers(None, 5.0) == ({}, True)


def test_the_watchdog_fires_unless_cancelled() -> None:
    fired = threading.Event()
    dog = DepartureWatchdog(timedelta(seconds=0.1), fired.set)
    dog.start()
    assert fired.wait(5)
    quiet = threading.Event()
    dog = DepartureWatchdog(timedelta(seconds=0.2), quiet.set)
    dog.start()
    dog.cancel()
    assert not quiet.wait(0.4)


# -- the departing agent --------------------------------------------------------------------


def _departing_agent(handler: FakeHandler, tmp_path: Path, ctx: FakeContext | None) -> Any:
    agent = _agent(handler, max_restarts=0)
    agent._events = EventLog(tmp_path, job="job-7", source="agent", node="me/1")
    agent._pcontext = ctx
    return agent


def test_a_notice_drains_the_workers_leaves_and_ends_the_run_as_planned(
    tmp_path: Path, contexts: list[FakeContext]
) -> None:
    handler = DepartingHandler()
    agent = _departing_agent(handler, tmp_path, _context(contexts, DRAINS))
    agent._worker_group.workers[0].global_rank = 5  # as torch assigns it at the rendezvous
    agent.request_departure(_notice(120))
    agent.request_departure(_notice(1))  # a second notice changes nothing

    with pytest.raises(PlannedDeparture) as raised:
        agent._monitor_workers(agent._worker_group)

    assert raised.value.drained and raised.value.notice.source == "aws"
    assert handler.calls == ["announce aws", "leave"]
    events = {e["event"]: e for e in read_events(tmp_path)}
    assert events["planned_departure"] == {
        **events["planned_departure"], "notice": "aws", "round": 4, "member_ttl": 30,
        "announced": True, "drain_budget_s": 60.0}
    assert events["left_rendezvous"]["drained"] is True
    assert events["left_rendezvous"]["exit_codes"] == {"5": 143}
    assert agent._watchdog is not None and agent._watchdog._cancelled.is_set()


def test_an_etcd_failure_while_announcing_does_not_stop_the_departure(
    tmp_path: Path, contexts: list[FakeContext]
) -> None:
    handler = DepartingHandler()
    handler.fail_announce = True
    agent = _departing_agent(handler, tmp_path, _context(contexts, DRAINS))
    agent.request_departure(_notice(None))
    with pytest.raises(PlannedDeparture):
        agent._monitor_workers(agent._worker_group)
    assert handler.calls == ["announce aws", "leave"]
    (event,) = [e for e in read_events(tmp_path) if e["event"] == "planned_departure"]
    assert event["announced"] is False


def test_a_notice_before_the_rendezvous_leaves_without_joining(tmp_path: Path) -> None:
    handler = DepartingHandler()
    agent = _departing_agent(handler, tmp_path, None)
    agent.request_departure(_notice(30))
    with pytest.raises(PlannedDeparture):
        agent._rendezvous(agent._worker_group)  # never reaches torch's next_rendezvous
    assert handler.calls == ["announce aws", "leave"]


def test_the_watchdog_exit_revokes_the_lease_and_exits_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = DepartingHandler()
    agent = _departing_agent(handler, tmp_path, None)
    exits: list[int] = []
    monkeypatch.setattr("launch.agent.os._exit", exits.append)
    agent._emergency_exit()
    assert exits == [0] and handler.calls == ["leave lease"]
    kinds = [(e["event"], e.get("outcome")) for e in read_events(tmp_path)]
    assert kinds == [("left_rendezvous", None), ("agent_exited", "departed")]


# -- the peers ------------------------------------------------------------------------------


def _monitor_returns(monkeypatch: pytest.MonkeyPatch, result: RunResult) -> None:
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, wg: result)


def test_a_worker_failure_in_a_round_a_peer_is_leaving_is_not_charged(
    tmp_path: Path, restarts: list[int], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    handler = DepartingHandler()
    agent = _departing_agent(handler, tmp_path, None)
    _monitor_returns(monkeypatch, FAILED)
    handler.departing = {1}
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.HEALTHY
    assert restarts == [1] and agent.remaining_restarts == 0
    events = [(e["event"], e.get("cause") or e.get("ranks")) for e in read_events(tmp_path)]
    assert events == [("peer_departed", [1]), ("worker_failed", "planned_departure")]
    assert agent._next_reason == "planned_departure"


def test_workers_that_exit_zero_after_a_peers_drain_start_a_new_round(
    tmp_path: Path, restarts: list[int], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    handler = DepartingHandler()
    agent = _departing_agent(handler, tmp_path, None)
    _monitor_returns(monkeypatch, RunResult(state=WorkerState.SUCCEEDED,
                                            return_values={0: None}))
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.SUCCEEDED
    handler.departing = {2}
    assert agent._monitor_workers(agent._worker_group).state == WorkerState.HEALTHY
    assert restarts == [1] and agent.membership_restarts == 1


def test_a_lost_node_is_reported_once_per_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler = DepartingHandler()
    agent = _departing_agent(handler, tmp_path, None)
    _monitor_returns(monkeypatch, RunResult(state=WorkerState.HEALTHY))
    handler.lost = {"2"}
    for _ in range(3):
        agent._monitor_workers(agent._worker_group)
    assert [e["event"] for e in read_events(tmp_path)] == ["node_lost"]


# -- command line ---------------------------------------------------------------------------


def test_the_preemption_and_event_flags_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    for name in ("ELASTIC_PREEMPTION_WATCH", "ELASTIC_EVENTS_DIR", "ELASTIC_AWS_METADATA_URL"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    args = cli.parse_args(["--standalone", "--preemption-watch", "aws,sigterm",
                           "--aws-metadata-url", "http://127.0.0.1:1", "--events-dir",
                           str(tmp_path), "--preemption-drain-timeout", "20", str(script)])
    assert (args.preemption_watch, args.aws_metadata_url, args.events_dir,
            args.preemption_drain_timeout) == ("aws,sigterm", "http://127.0.0.1:1",
                                               str(tmp_path), 20.0)
    monkeypatch.setenv("ELASTIC_PREEMPTION_WATCH", "auto")
    assert cli.parse_args(["--standalone", str(script)]).preemption_watch == "auto"
    monkeypatch.delenv("ELASTIC_PREEMPTION_WATCH")
    assert cli.parse_args(["--standalone", str(script)]).preemption_watch == "none"


@pytest.mark.parametrize(("flags", "named"), [
    (["--preemption-watch", "aws,oracle"], "'oracle'"),
    (["--preemption-drain-timeout", "0"], "--preemption-drain-timeout (0.0)"),
    (["--sigterm-grace-period", "-1"], "--sigterm-grace-period (-1.0)"),
])
def test_bad_preemption_flags_are_one_sentence_errors(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        cli.parse_args(["--standalone", *flags, str(script)])


def test_with_the_sigterm_watcher_torch_no_longer_turns_sigterm_into_an_abort() -> None:
    assert _without_sigterm("SIGTERM,SIGINT,SIGHUP,SIGQUIT") == "SIGINT,SIGHUP,SIGQUIT"
    assert _without_sigterm("SIGINT") == "SIGINT"

