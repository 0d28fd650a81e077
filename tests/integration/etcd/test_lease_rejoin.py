"""A node whose lease is gone takes a new lease and rejoins (issue 25, fault 2), on real etcd.

An expired lease is a normal event: etcd stalled, a long garbage-collection pause, a host
starved of CPU. Here a node's lease is revoked under it (what etcd does when it expires), and
the node must be back in the run under the same id, on a new lease, with no call from its
owner; a put that names the gone lease before the keep-alive thread noticed renews it too.
torchrun's plugin handler, which used to fail every node with "requested lease not found",
rejoins the same way and is placed in the next world. Last, a real etcd is paused past the
lease TTL (SIGSTOP, what a stalled etcd does), and every node comes back.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from elastic.contract.records import NodeRecord, WorkerSlot
from membership.decide import RunLimits
from membership.etcd import EtcdClient, EtcdConfig
from membership.generation import open_run
from membership.job import RunMembership, new_node_id
from membership.keys import JobKeys

pytestmark = pytest.mark.etcd

TTL = 2


def _client(endpoint: str) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=(endpoint,), request_timeout=timedelta(seconds=2),
                                 deadline=timedelta(seconds=15)))


def _record(port: int) -> NodeRecord:
    return NodeRecord(node=new_node_id("sim"), host="sim", addr="127.0.0.1", agent_pid=0,
                      store_port=port, workers=(WorkerSlot(0, 1, True, True, 0),))


class _Node:
    def __init__(self, endpoint: str, keys: JobKeys, limits: RunLimits, port: int) -> None:
        self.client = _client(endpoint)
        self.lost = threading.Event()
        self.back = threading.Event()
        self.run = RunMembership(self.client, keys, limits=limits, ttl=TTL, linger=2,
                                 on_lease_lost=self.lost.set, on_rejoined=self.back.set,
                                 rejoin_timeout=60)
        self.record = _record(port)
        self.run.join(self.record)

    @property
    def key(self) -> str:
        return self.run.keys.node(self.record.node)


@pytest.fixture
def nodes(etcd_server: Any, etcd_prefix: str) -> Iterator[tuple[JobKeys, list[_Node]]]:
    keys = open_run(_client(etcd_server.endpoint), JobKeys(etcd_prefix, "job")).keys
    made: list[_Node] = []
    yield keys, made
    for node in made:
        node.run.leave()


def _until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_node_whose_lease_is_revoked_rejoins_under_the_same_id(
    etcd_server: Any, nodes: tuple[JobKeys, list[_Node]]
) -> None:
    keys, made = nodes
    limits = RunLimits(min_nodes=2, max_nodes=2, last_call=0.3)
    made += [_Node(etcd_server.endpoint, keys, limits, 4000 + i) for i in range(2)]
    a, b = made
    assert a.run.wait(lambda v: (w := v.world()) is not None and len(w.members) == 2, 15)
    first = a.run.world()
    assert first is not None
    old = b.run.node.lease
    assert old is not None
    a.client.revoke_lease(old.id)  # what etcd does when the lease expires
    assert b.lost.wait(10), "the node did not notice its lease was gone"
    assert b.back.wait(15), "the node did not join again"
    kv = a.client.get(b.key)
    assert kv is not None and kv.lease not in (0, old.id)
    assert NodeRecord.loads(kv.value, kv.key).node == b.record.node
    assert b.run.node.rejoins == 1
    # The others dropped it (its lease was gone) and take it back in a newer world.
    world = a.run.world()
    assert a.run.wait(lambda v: (w := v.world()) is not None and w.epoch > first.epoch
                      and b.record.node in w.nodes(), 15), world
    _until(b.run.in_sync, 10, "the rejoined node to be in sync (fresh lease, view caught up)")


def test_a_put_naming_a_gone_lease_takes_a_new_one(
    etcd_server: Any, nodes: tuple[JobKeys, list[_Node]]
) -> None:
    keys, made = nodes
    made.append(_Node(etcd_server.endpoint, keys, RunLimits(1, 1, 0.3), 4100))
    node = made[0]
    lease = node.run.node.lease
    assert lease is not None
    lease.stop()  # no keep-alive thread to notice: the next put finds out
    node.client.revoke_lease(lease.id)
    node.run.update(restarts=1)  # the put renews the lease and is written
    kv = node.client.get(node.key)
    assert kv is not None and kv.lease != lease.id
    assert NodeRecord.loads(kv.value, kv.key).restarts == 1


def test_the_torchrun_plugin_rejoins_after_its_lease_is_gone(
    etcd_server: Any, etcd_prefix: str
) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from membership.config import RdzvConf
    from membership.torch_handler import EtcdV3RendezvousHandler

    handlers = []
    conf = RdzvConf.parse({"member_ttl": TTL, "last_call_timeout": 0.3,
                           "key_prefix": etcd_prefix, "join_timeout": 30})
    for _ in range(2):
        params = RendezvousParameters("etcd-v3", etcd_server.endpoint, "plugin-rejoin", 2, 2,
                                      local_addr="127.0.0.1")
        handlers.append(EtcdV3RendezvousHandler(params, _client(etcd_server.endpoint), conf))
    try:
        infos: list[Any] = [None, None]
        threads = [threading.Thread(target=lambda i=i: infos.__setitem__(
            i, handlers[i].next_rendezvous())) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(info is not None for info in infos)
        victim = handlers[1]
        lease = victim._run.node.lease
        assert lease is not None
        handlers[0]._client.revoke_lease(lease.id)
        # The others drop it, then take it back: torch's agent on both nodes sees a newer
        # world (num_nodes_waiting) and rendezvous again; the victim is in that world.
        _until(lambda: handlers[0].num_nodes_waiting() == 1, 20, "a newer world")
        again: list[Any] = [None, None]
        threads = [threading.Thread(target=lambda i=i: again.__setitem__(
            i, handlers[i].next_rendezvous())) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(info is not None for info in again), "a node did not rejoin"
        assert sorted(info.rank for info in again) == [0, 1]
        assert victim._run.node.rejoins >= 1
    finally:
        for handler in handlers:
            handler.shutdown()


@pytest.mark.slow
def test_every_node_rejoins_when_etcd_is_paused_past_the_lease_ttl(tmp_path: Any) -> None:
    """SIGSTOP the whole etcd for 5 s with a TTL of 2 s: every lease expires when it resumes
    (or is renewed by the keep-alives that were waiting), and every node is a member again."""
    from launch.etcd_server import EmbeddedEtcd, EtcdBinaryNotFoundError

    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd"))
    try:
        server.start()
    except EtcdBinaryNotFoundError as exc:
        if os.environ.get("ELASTIC_REQUIRE_ETCD"):
            raise
        pytest.skip(str(exc))
    made: list[_Node] = []
    try:
        keys = open_run(_client(server.endpoint), JobKeys("/elastic", "paused")).keys
        limits = RunLimits(min_nodes=3, max_nodes=3, last_call=0.3)
        made += [_Node(server.endpoint, keys, limits, 4200 + i) for i in range(3)]
        assert made[0].run.wait(lambda v: (w := v.world()) is not None
                                and len(w.members) == 3, 20)
        server.pause()
        time.sleep(5.0)
        server.resume()
        checker = _client(server.endpoint)
        _until(lambda: all(n.run.node.fresh() and checker.get(n.key) is not None
                           for n in made), 30, "every node to be a member again")
        assert made[0].run.wait(lambda v: (w := v.world()) is not None
                                and len(w.members) == 3
                                and all(n.record.node in w.nodes() for n in made), 30)
        print(f"[paused etcd] leases lost and retaken: {[n.run.node.rejoins for n in made]}")
    finally:
        for node in made:
            node.run.leave()
        server.stop()
