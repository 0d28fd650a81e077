"""SilentPeerWatch: checks while a worker waits, stops when it resumes, when a check says so,
or when the agent closes it (the etcd half is tested against real etcd in test_etcd_layer.py,
and the whole rule on network namespaces in test_netns_faults.py)."""

from __future__ import annotations

import threading
import time

import pytest

from membership.silent_peers import SilentPeerWatch, confirmed_silent, watched_peers


class _Checks:
    def __init__(self, stop_after: int | None = None) -> None:
        self.epochs: list[int] = []
        self.stop_after = stop_after
        self.called = threading.Event()

    def __call__(self, epoch: int) -> bool:
        self.epochs.append(epoch)
        self.called.set()
        return self.stop_after is not None and len(self.epochs) >= self.stop_after


def _idle(watch: SilentPeerWatch, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if watch._thread is None:
            return True
        time.sleep(0.01)
    return False


def test_it_checks_the_stalled_epoch_until_the_workers_resume() -> None:
    checks = _Checks()
    watch = SilentPeerWatch(checks, limit=60, interval=0.01)
    watch.stalled(7, 70)
    assert checks.called.wait(5)
    time.sleep(0.1)
    watch.resumed()
    assert _idle(watch)
    count = len(checks.epochs)
    assert count >= 2 and set(checks.epochs) == {7}
    time.sleep(0.1)
    assert len(checks.epochs) == count  # nothing after it resumed


def test_it_stops_when_a_check_removed_a_peer_and_starts_again_on_the_next_stall() -> None:
    checks = _Checks(stop_after=1)
    watch = SilentPeerWatch(checks, limit=60, interval=0.01)
    watch.stalled(3, 30)
    assert _idle(watch)
    assert checks.epochs == [3]
    checks.stop_after = 2
    watch.stalled(4, 40)
    assert _idle(watch)
    assert checks.epochs == [3, 4]


def test_a_failing_check_stops_the_watch_instead_of_killing_the_agent() -> None:
    def broken(epoch: int) -> bool:
        raise RuntimeError("etcd said no")

    watch = SilentPeerWatch(broken, limit=60, interval=0.01)
    watch.stalled(1, 10)
    assert _idle(watch)


def test_a_closed_watch_never_checks() -> None:
    checks = _Checks()
    watch = SilentPeerWatch(checks, limit=60, interval=0.01)
    watch.close()
    watch.stalled(1, 10)
    time.sleep(0.1)
    assert checks.epochs == [] and watch._thread is None


def test_a_wait_is_checked_only_until_a_silent_peers_lease_would_have_expired_anyway() -> None:
    checks = _Checks()
    watch = SilentPeerWatch(checks, limit=0.2, interval=0.01)
    watch.stalled(5, 50)
    assert _idle(watch)  # it gave up by itself, without a resume
    count = len(checks.epochs)
    assert count >= 2
    watch.stalled(5, 50)  # the same wait, reported again: not checked again
    assert _idle(watch)
    assert len(checks.epochs) == count
    watch.stalled(5, 51)  # the next step's wait is
    assert _idle(watch)
    assert len(checks.epochs) > count


def test_each_node_checks_the_next_few_members_so_every_member_is_checked_by_as_many() -> None:
    members = [f"n{i}" for i in range(10)]
    assert watched_peers(members, "n0") == ["n1", "n2", "n3"]
    assert watched_peers(members, "n8") == ["n9", "n0", "n1"]
    assert watched_peers(["a", "b", "c"], "b") == ["c", "a"]
    assert watched_peers(["a", "b"], "z") == []
    checked_by = {m: 0 for m in members}
    for me in members:
        for peer in watched_peers(members, me):
            checked_by[peer] += 1
    assert set(checked_by.values()) == {3}


@pytest.mark.parametrize(("lease_reads", "probe", "gone", "asked"), [
    # Silent and unrefreshed at both reads: gone.
    ((True, True), True, True, ["lease", "probe", "lease"]),
    # The node asking was the one cut off: its link came back between its first probe and
    # etcd's answer; the peer answers the fresh probe (found by CI on namespaces).
    ((True,), False, False, ["lease", "probe"]),
    # A keep-alive only late: etcd's whole-second truncation read it as a missed period, and
    # the second read, after the probe, sees it refreshed.
    ((True, False), True, False, ["lease", "probe", "lease"]),
    # A refreshed lease ends the check before any probe.
    ((False,), True, False, ["lease"]),
])
def test_a_silent_peer_is_removed_only_if_a_fresh_probe_and_a_second_lease_read_agree(
    lease_reads: tuple[bool, ...], probe: bool, gone: bool, asked: list[str],
) -> None:
    calls: list[str] = []
    reads = list(lease_reads)

    def lease() -> bool:
        calls.append("lease")
        return reads.pop(0)

    def probed() -> bool:
        calls.append("probe")
        return probe

    assert confirmed_silent(lease, probed) is gone
    assert calls == asked
