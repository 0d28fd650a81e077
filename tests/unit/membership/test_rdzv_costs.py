"""What membership costs etcd, counted write by write: a join, a heartbeat, a round close.

The agents are real :class:`~membership.job.RunMembership` objects (their lease threads,
watches and leader loops run) over the in-memory etcd of ``tests/fakes.py``, which records
every write. The same three figures are checked against a real etcd in
``tests/integration/etcd/test_rdzv_protocol.py::test_etcd_writes_per_join_heartbeat_and_round``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic.contract.records import NodeRecord, WorkerSlot
from membership.decide import RunLimits
from membership.generation import open_run
from membership.job import RunMembership
from membership.keys import JobKeys
from tests.fakes import FakeEtcd, fake_client

TTL = 1  # keep-alives every 0.33 s (the lease thread is real; the fake clock never expires it)
_WRITES = ("put", "put_many", "cas", "delete", "delete_prefix", "grant_lease", "revoke_lease")


class CountingEtcd(FakeEtcd):
    """The fake etcd, logging every write as ``(operation, key)`` (a lease op names no key)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self._log_lock = threading.Lock()
        for name in _WRITES:
            setattr(self, name, self._logged(name, getattr(self, name)))

    def _logged(self, name: str, method: Any) -> Any:
        def logged(*args: Any, **kwargs: Any) -> Any:
            key = args[0] if args and isinstance(args[0], str) else ""
            with self._log_lock:
                self.log.append((name, key))
            return method(*args, **kwargs)
        return logged

    def mark(self) -> int:
        with self._log_lock:
            return len(self.log)

    def since(self, mark: int) -> list[tuple[str, str]]:
        with self._log_lock:
            return self.log[mark:]


def record(name: str, slots: int = 8) -> NodeRecord:
    return NodeRecord(node=name, host=name, addr="127.0.0.1", agent_pid=1, store_port=5000,
                      workers=tuple(WorkerSlot(i, 1, True, True, 0) for i in range(slots)))


def wait(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def etcd() -> CountingEtcd:
    return CountingEtcd()


@pytest.fixture
def runs() -> Iterator[list[RunMembership]]:
    made: list[RunMembership] = []
    yield made
    for run in made:
        run.leave()


def test_a_join_a_heartbeat_and_a_round_close_cost_one_put_nothing_and_one_cas(
    etcd: CountingEtcd, runs: list[RunMembership]
) -> None:
    keys = open_run(fake_client(etcd), JobKeys("/t", "job")).keys
    # A settle far longer than the test: the round closes because it is complete (max nodes,
    # every slot ready), so every write of the close is the close's own.
    limits = RunLimits(min_nodes=2, max_nodes=3, last_call=60.0)

    def join(name: str) -> tuple[RunMembership, list[tuple[str, str]]]:
        run = RunMembership(fake_client(etcd), keys, limits=limits, ttl=TTL)
        runs.append(run)
        mark = etcd.mark()
        run.join(record(name))
        return run, etcd.since(mark)

    first, writes = join("a")
    wait(lambda: first.leader.leading)  # the first node elects itself: one create attempt
    assert etcd.since(0)[-3:] == [("grant_lease", ""), ("put", keys.node("a")),
                                  ("cas", keys.leader)]
    assert writes[:2] == [("grant_lease", ""), ("put", keys.node("a"))]

    # Each later join: its lease and one put of its own key. Nobody else's data is rewritten,
    # nobody campaigns (a leader is there), and the leader writes nothing while too few are in
    # (whenever it sees b: everything written from b's join on is counted below).
    mark = etcd.mark()
    _, writes = join("b")
    assert writes == [("grant_lease", ""), ("put", keys.node("b"))]
    third, writes = join("c")
    assert writes[:2] == [("grant_lease", ""), ("put", keys.node("c"))]

    # The round closes with one compare-and-swap of the world, and nothing else.
    assert third.wait(lambda v: (w := v.world()) is not None and len(w.members) == 3, 10)
    wait(lambda: first.leader.stats.cas_won == 1)
    assert etcd.since(mark) == [("grant_lease", ""), ("put", keys.node("b")),
                                ("grant_lease", ""), ("put", keys.node("c")),
                                ("cas", keys.world)]
    assert first.leader.stats.cas_attempts == 1

    # Heartbeats: lease keep-alives only, no write at all, however long it takes the three
    # nodes' keep-alive threads to send three each.
    mark, beats = etcd.mark(), etcd.calls.get("keepalive", 0)
    wait(lambda: etcd.calls.get("keepalive", 0) - beats >= 3 * 3, timeout=60)
    assert etcd.since(mark) == []

    # A node leaving costs its own lease revocation, then the leader's one CAS.
    mark = etcd.mark()
    runs.remove(third)
    third.leave()
    assert first.wait(lambda v: (w := v.world()) is not None and w.epoch == 2, 10)
    wait(lambda: first.leader.stats.cas_won == 2)
    assert etcd.since(mark) == [("revoke_lease", ""), ("cas", keys.world)]
