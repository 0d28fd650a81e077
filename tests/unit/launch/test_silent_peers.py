"""SilentPeerWatch: checks while a worker waits, stops when it resumes, when a check says so,
or when the agent closes it (the etcd half is tested against real etcd in test_etcd_layer.py,
and the whole rule on network namespaces in test_netns_faults.py)."""

from __future__ import annotations

import threading
import time

from launch.silent_peers import SilentPeerWatch


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
    watch = SilentPeerWatch(checks, interval=0.01)
    watch.stalled(7)
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
    watch = SilentPeerWatch(checks, interval=0.01)
    watch.stalled(3)
    assert _idle(watch)
    assert checks.epochs == [3]
    checks.stop_after = 2
    watch.stalled(4)
    assert _idle(watch)
    assert checks.epochs == [3, 4]


def test_a_failing_check_stops_the_watch_instead_of_killing_the_agent() -> None:
    def broken(epoch: int) -> bool:
        raise RuntimeError("etcd said no")

    watch = SilentPeerWatch(broken, interval=0.01)
    watch.stalled(1)
    assert _idle(watch)


def test_a_closed_watch_never_checks() -> None:
    checks = _Checks()
    watch = SilentPeerWatch(checks, interval=0.01)
    watch.close()
    watch.stalled(1)
    time.sleep(0.1)
    assert checks.epochs == [] and watch._thread is None
