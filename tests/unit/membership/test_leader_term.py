"""The term a leader fences its world writes with follows the leader key it holds now.

A node that lost its lease joins again under the same node id on a new lease (membership.node)
and may be elected again: a new leader key, with a new create revision, naming the same node.
A view rebuilt from a snapshot (a watch resync after a failure or a compaction) can show the
new key without ever showing the old one's deletion. The leader must then fence with the new
term: fenced by the old one, every world write it makes would be refused, for good.

The view here reads etcd directly, the most up-to-date view there is; the node's membership is
reduced to its id and its current lease. Real processes and a real etcd:
``tests/integration/etcd/test_deposed_leader.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from elastic.contract.records import EndRecord
from membership.decide import RunLimits
from membership.etcd import KeyValue
from membership.keys import JobKeys
from membership.leader import LeaderLoop
from tests.fakes import FakeEtcd

KEYS = JobKeys("/elastic-test", "term", 1)


@dataclass
class _Lease:
    id: int
    lost: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Record:
    node: str


@dataclass
class _Node:
    record: _Record
    lease: _Lease


class _DirectView:
    """What the leader reads of the run's keys, straight from etcd."""

    def __init__(self, etcd: FakeEtcd) -> None:
        self._etcd = etcd

    def add_listener(self, listener: Any) -> None:
        pass

    def leader_kv(self) -> KeyValue | None:
        return self._etcd.get(KEYS.leader)

    def leader(self) -> str | None:
        kv = self.leader_kv()
        return kv.value.decode() if kv is not None and kv.lease else None


@pytest.fixture
def etcd() -> FakeEtcd:
    return FakeEtcd()


@pytest.fixture
def node(etcd: FakeEtcd) -> _Node:
    return _Node(_Record("a"), _Lease(etcd.grant_lease(10)))


@pytest.fixture
def loop(etcd: FakeEtcd, node: _Node) -> Iterator[LeaderLoop]:
    ended: list[EndRecord] = []
    loop = LeaderLoop(etcd, KEYS, node, _DirectView(etcd),  # type: ignore[arg-type]
                      RunLimits(min_nodes=1, max_nodes=2), ended.append)
    yield loop
    loop.stop()


def _fenced_write(etcd: FakeEtcd, loop: LeaderLoop) -> bool:
    return etcd.cas(KEYS.world, b"w", None, fence=loop._fence())[0]


def test_a_leader_elected_again_under_its_name_fences_with_the_new_term(
    etcd: FakeEtcd, node: _Node, loop: LeaderLoop,
) -> None:
    assert loop._campaign() and loop.leading
    first = etcd.get(KEYS.leader)
    assert first is not None and first.lease == node.lease.id
    # The lease is lost; the node joins again on a new lease and is elected again. The view
    # never shows the leader key absent.
    etcd.revoke_lease(node.lease.id)
    node.lease = _Lease(etcd.grant_lease(10))
    assert etcd.cas(KEYS.leader, b"a", None, lease=node.lease.id)[0]
    second = etcd.get(KEYS.leader)
    assert second is not None and second.create_revision != first.create_revision
    assert loop._campaign() and loop.leading
    assert loop._fence() == (KEYS.leader, second.create_revision)
    assert _fenced_write(etcd, loop), "the leader's world write was refused by its own term"


def test_the_key_of_a_lost_lease_is_no_term_of_the_node_that_joined_again(
    etcd: FakeEtcd, node: _Node, loop: LeaderLoop,
) -> None:
    assert loop._campaign() and loop.leading
    # The node joined again on a new lease before etcd deleted the old key: the key names
    # this node, but its term ended with the lease it lost.
    node.lease = _Lease(etcd.grant_lease(10))
    assert not loop._campaign()
    assert not loop.leading
