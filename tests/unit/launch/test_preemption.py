"""Preemption watchers against fake metadata servers on 127.0.0.1 (real HTTP, real signals)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from elastic.errors import ConfigError
from launch.preemption import (
    AwsSpotWatcher,
    AzureScheduledEventsWatcher,
    GcpPreemptionWatcher,
    PreemptionMonitor,
    PreemptionNotice,
    SigtermWatcher,
    detect_watchers,
    parse_watch_spec,
)
from tests.unit.launch.test_preemption_fakes import FakeState, serve

FAST = timedelta(milliseconds=50)
WAIT = timedelta(seconds=10)


class Collector:
    def __init__(self) -> None:
        self.notices: list[PreemptionNotice] = []
        self.event = threading.Event()

    def __call__(self, notice: PreemptionNotice) -> None:
        self.notices.append(notice)
        self.event.set()


def _preempt_event(resources: list[str]) -> dict[str, Any]:
    return {
        "EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
        "ResourceType": "VirtualMachine", "Resources": resources, "EventStatus": "Scheduled",
        "NotBefore": "Mon, 19 Sep 2030 18:29:47 GMT", "Description": "", "EventSource": "Platform",
    }


def test_aws_watcher_reports_a_scheduled_spot_interruption_with_its_deadline() -> None:
    with serve("aws") as (url, state):
        watcher = AwsSpotWatcher(base_url=url, poll_interval=FAST)
        assert watcher.check() is None
        state.preempt()
        notice = watcher.check()
    assert notice is not None
    assert notice.source == "aws"
    assert notice.deadline == datetime(2030, 1, 1, 0, 2, tzinfo=timezone.utc)
    assert '"terminate"' in notice.detail


def test_aws_watcher_uses_an_imdsv2_token_with_a_ttl_and_reuses_it() -> None:
    with serve("aws") as (url, state):
        watcher = AwsSpotWatcher(base_url=url)
        for _ in range(3):
            assert watcher.check() is None
    puts = [r for r in state.requests if r[0] == "PUT"]
    gets = [r for r in state.requests if r[0] == "GET"]
    assert len(puts) == 1
    assert puts[0][2]["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert {g[2]["X-aws-ec2-metadata-token"] for g in gets} == {"token-1"}


def test_aws_watcher_renews_its_token_when_imds_rejects_it() -> None:
    with serve("aws") as (url, state):
        watcher = AwsSpotWatcher(base_url=url)
        assert watcher.check() is None
        state.tokens.clear()  # IMDS forgot every token (expiry, restart)
        state.preempt()
        notice = watcher.check()
    assert notice is not None
    assert state.token_count == 2


def test_gcp_watcher_long_poll_returns_when_the_instance_is_preempted() -> None:
    with serve("gcp") as (url, state):
        watcher = GcpPreemptionWatcher(base_url=url, poll_interval=FAST)
        collector = Collector()
        watcher.start(collector)
        try:
            # Wait until the watcher is inside its long poll, then preempt.
            for _ in range(200):
                if state.long_polls:
                    break
                threading.Event().wait(0.02)
            assert not collector.event.is_set()
            state.preempt()
            assert collector.event.wait(WAIT.total_seconds())
        finally:
            watcher.stop()
    assert [n.source for n in collector.notices] == ["gcp"]
    assert collector.notices[0].deadline is not None
    waits = [r for r in state.requests if r[1].endswith("/preempted")]
    assert all(r[2]["Metadata-Flavor"] == "Google" for r in waits)


def test_gcp_watcher_sees_a_preemption_that_happened_before_it_started() -> None:
    with serve("gcp", FakeState(preempted=True)) as (url, _state):
        notice = GcpPreemptionWatcher(base_url=url).check()
    assert notice is not None and notice.detail == "preempted=TRUE"


def test_gcp_watcher_reports_nothing_while_preempted_is_false() -> None:
    with serve("gcp", FakeState(hang_s=0.1)) as (url, _state):
        watcher = GcpPreemptionWatcher(base_url=url, long_poll=timedelta(seconds=1))
        assert watcher.check() is None  # plain read
        assert watcher.check() is None  # long poll that ends unchanged


def test_azure_watcher_reports_a_preempt_event_for_this_vm() -> None:
    state = FakeState(events=[_preempt_event(["other-vm"])])
    with serve("azure", state) as (url, state):
        watcher = AzureScheduledEventsWatcher(base_url=url, vm_name="this-vm")
        assert watcher.check() is None  # another VM's event is not ours
        state.events.append(_preempt_event(["this-vm"]))
        notice = watcher.check()
    assert notice is not None and notice.source == "azure"
    assert notice.deadline == datetime(2030, 9, 19, 18, 29, 47, tzinfo=timezone.utc)
    assert all(r[2]["Metadata"] == "true" for r in state.requests)


def test_azure_watcher_ignores_maintenance_events_that_are_not_preemptions() -> None:
    event = {**_preempt_event(["vm"]), "EventType": "Freeze"}
    with serve("azure", FakeState(events=[event])) as (url, _state):
        assert AzureScheduledEventsWatcher(base_url=url).check() is None


def test_watcher_thread_calls_back_exactly_once_and_stops() -> None:
    with serve("aws") as (url, state):
        watcher = AwsSpotWatcher(base_url=url, poll_interval=FAST)
        collector = Collector()
        watcher.start(collector)
        state.preempt()
        assert collector.event.wait(WAIT.total_seconds())
        threading.Event().wait(0.3)  # several poll intervals: no second call
        watcher.stop()
    assert len(collector.notices) == 1
    assert watcher.fired
    assert watcher._thread is not None and not watcher._thread.is_alive()


def test_a_server_that_never_answers_does_not_hang_the_watcher() -> None:
    # A listening socket that accepts nothing: connects succeed, reads time out.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        watcher = AwsSpotWatcher(
            base_url=url, poll_interval=FAST, request_timeout=timedelta(milliseconds=200)
        )
        with pytest.raises(Exception, match=r"(?i)timed? ?out"):
            watcher.check()
        collector = Collector()
        watcher.start(collector)
        threading.Event().wait(0.5)
        watcher.stop(timeout=timedelta(seconds=3))
        assert watcher._thread is not None and not watcher._thread.is_alive()
    assert collector.notices == []


def test_auto_detection_on_a_machine_outside_any_cloud_keeps_only_sigterm() -> None:
    with socket.socket() as sock:  # nothing listens on this port once closed
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    watchers = detect_watchers(
        "auto", aws_url=dead, gcp_url=dead, azure_url=dead,
        probe_timeout=timedelta(milliseconds=300),
    )
    assert [w.source for w in watchers] == ["sigterm"]


def test_auto_detection_finds_the_cloud_whose_metadata_server_answers() -> None:
    with serve("gcp") as (gcp, _s), serve("aws") as (aws, _t):
        # Each fake answers only its own protocol, so pointing all three at one shows
        # that a probe does not mistake another cloud's server for its own.
        assert [w.source for w in detect_watchers("auto", aws_url=gcp, gcp_url=gcp,
                                                  azure_url=gcp)] == ["gcp", "sigterm"]
        assert [w.source for w in detect_watchers("auto", aws_url=aws, gcp_url=aws,
                                                  azure_url=aws)] == ["aws", "sigterm"]


def test_watch_spec_accepts_lists_auto_and_none_and_rejects_unknown_sources() -> None:
    assert parse_watch_spec("aws, gcp,aws") == ("aws", "gcp")
    assert parse_watch_spec("none") == ()
    assert parse_watch_spec("AUTO") == ("auto",)
    assert [w.source for w in detect_watchers("azure,sigterm")] == ["azure", "sigterm"]
    with pytest.raises(ConfigError, match="'oracle'"):
        parse_watch_spec("aws,oracle")
    with pytest.raises(ConfigError, match="auto"):
        parse_watch_spec("auto,aws")


def test_watchers_reject_a_non_positive_poll_interval() -> None:
    with pytest.raises(ConfigError, match="poll_interval"):
        AwsSpotWatcher(base_url="http://127.0.0.1:1", poll_interval=timedelta(0))


def test_sigterm_becomes_a_notice_and_chains_to_the_previous_handler() -> None:
    previous_calls: list[int] = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: previous_calls.append(signum))
    try:
        watcher = SigtermWatcher(grace_period=timedelta(seconds=60))
        collector = Collector()
        watcher.start(collector)
        os.kill(os.getpid(), signal.SIGTERM)
        assert collector.event.wait(WAIT.total_seconds())
        watcher.stop()
        notice = collector.notices[0]
        assert notice.source == "sigterm"
        left = notice.time_left()
        assert left is not None and timedelta(seconds=50) < left <= timedelta(seconds=60)
        assert previous_calls == [signal.SIGTERM]
        # stop() put the previous handler back.
        os.kill(os.getpid(), signal.SIGTERM)
        assert previous_calls == [signal.SIGTERM, signal.SIGTERM]
        assert len(collector.notices) == 1
    finally:
        signal.signal(signal.SIGTERM, original)


def test_sigterm_watcher_refuses_to_start_off_the_main_thread() -> None:
    errors: list[BaseException] = []

    def start() -> None:
        try:
            SigtermWatcher().start(Collector())
        except ConfigError as exc:
            errors.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(5)
    assert errors and "main thread" in str(errors[0])


def test_monitor_delivers_only_the_first_notice_of_several_sources() -> None:
    with serve("aws", FakeState(preempted=True)) as (aws, _a), \
            serve("gcp", FakeState(preempted=True)) as (gcp, _g):
        monitor = PreemptionMonitor([
            AwsSpotWatcher(base_url=aws, poll_interval=FAST),
            GcpPreemptionWatcher(base_url=gcp, poll_interval=FAST),
        ])
        collector = Collector()
        with monitor:
            monitor.start(collector)
            notice = monitor.wait(WAIT)
            threading.Event().wait(0.2)
    assert notice is not None and notice.source in ("aws", "gcp")
    assert collector.notices == [notice]


def test_sigterm_watcher_reinstalls_itself_over_a_later_handler_and_chains_to_it() -> None:
    original = signal.getsignal(signal.SIGTERM)
    later_calls: list[int] = []
    try:
        watcher = SigtermWatcher()
        collector = Collector()
        watcher.start(collector)
        assert not watcher.ensure_installed()
        # What torch's PContext.start does on every worker (re)start:
        signal.signal(signal.SIGTERM, lambda signum, frame: later_calls.append(signum))
        assert watcher.ensure_installed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert collector.event.wait(WAIT.total_seconds())
        assert later_calls == [signal.SIGTERM]
        watcher.stop()
    finally:
        signal.signal(signal.SIGTERM, original)
