"""The membership protocol against a real etcd: simulated agents (threads) join, leave, lead.

Every agent here is a real :class:`RunMembership` over its own client; the assertions are on
what etcd holds and on what each agent's view shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from elastic.contract.records import EndRecord, NodeRecord, WorkerSlot, WorldRecord
from membership.decide import RunLimits
from membership.etcd import EtcdClient, EtcdConfig
from membership.generation import end_run, open_run
from membership.job import RunMembership, new_node_id
from membership.keys import JobKeys

pytestmark = pytest.mark.etcd

TTL = 2


def client_for(server: object) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=(server.endpoint,),  # type: ignore[attr-defined]
                                 request_timeout=timedelta(seconds=2),
                                 deadline=timedelta(seconds=10)))


class Sim:
    """A simulated agent: a node record with ready workers and the protocol machinery."""

    def __init__(self, server: object, keys: JobKeys, limits: RunLimits, slots: int = 1,
                 port: int = 4000, ttl: int = TTL) -> None:
        self.client = client_for(server)
        self.run = RunMembership(self.client, keys, limits=limits, ttl=ttl, linger=2)
        self.record = NodeRecord(
            node=new_node_id("sim"), host="sim", addr="127.0.0.1", agent_pid=0,
            store_port=port,
            workers=tuple(WorkerSlot(i, 1, True, True, 0) for i in range(slots)))

    def join(self) -> Sim:
        self.run.join(self.record)
        return self

    @property
    def me(self) -> str:
        return self.record.node


@pytest.fixture
def keys(etcd_server: object, etcd_prefix: str) -> JobKeys:
    return open_run(client_for(etcd_server), JobKeys(etcd_prefix, "job")).keys


@pytest.fixture
def sims() -> Iterator[list[Sim]]:
    made: list[Sim] = []
    yield made
    for sim in made:
        sim.run.leave()


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_world(sim: Sim, pred: object, timeout: float = 15.0) -> WorldRecord:
    assert sim.run.wait(lambda v: (w := v.world()) is not None and pred(w),  # type: ignore[operator]
                        timeout), f"no such world; last: {sim.run.world()}"
    world = sim.run.world()
    assert world is not None
    return world


def test_nodes_form_one_world_and_a_lost_node_is_dropped_at_once(
    etcd_server: object, keys: JobKeys, sims: list[Sim]
) -> None:
    # A settle and a lease TTL far longer than the test, so that "at once" can be told apart
    # from both on a loaded machine: the round closes because it is complete (max nodes,
    # every slot ready), and a node that leaves revokes its lease.
    ttl, limits = 20, RunLimits(min_nodes=2, max_nodes=3, last_call=20.0)
    sims += [Sim(etcd_server, keys, limits, port=4000 + i, ttl=ttl).join() for i in range(3)]
    world = wait_world(sims[0], lambda w: len(w.members) == 3)
    assert world.epoch == 1  # one round, not one per join
    assert set(world.nodes()) == {s.me for s in sims}
    for sim in sims:  # every agent sees the same world
        assert wait_world(sim, lambda w: w.epoch == 1) == world
    leaders = [s for s in sims if s.run.leader.leading]
    assert len(leaders) == 1
    leader = leaders[0]
    assert leader.run.leader.stats.cas_attempts == 1

    victim = next(s for s in sims if s is not leader)
    started = time.monotonic()
    victim.run.leave()
    sims.remove(victim)
    after = wait_world(leader, lambda w: victim.me not in w.nodes())
    assert after.epoch == 2
    # The design: a revoked lease deletes the record at once and a loss is written at once;
    # waiting for the settle or the TTL would take 20 s.
    took = time.monotonic() - started
    assert took < ttl / 2, f"the loss was written {took:.1f} s after the node left"
    # Survivors keep their ranks.
    assert after.nodes() == tuple(n for n in world.nodes() if n != victim.me)


def test_the_leader_is_replaced_and_a_silent_node_goes_at_its_ttl(
    etcd_server: object, keys: JobKeys, sims: list[Sim]
) -> None:
    limits = RunLimits(min_nodes=1, max_nodes=4, last_call=0.3)
    sims += [Sim(etcd_server, keys, limits, port=4000 + i).join() for i in range(3)]
    first = wait_world(sims[0], lambda w: len(w.members) == 3)
    leader = next(s for s in sims if s.run.leader.leading)
    # The leader goes silent: its lease is no longer refreshed, nothing is revoked.
    leader.run.leader.stop()
    leader.run.node.stop_refreshing()
    leader.run.view.close()
    sims.remove(leader)
    started = time.monotonic()
    after = wait_world(sims[0], lambda w: leader.me not in w.nodes(), timeout=TTL + 6)
    took = time.monotonic() - started
    assert took >= TTL - 1.0  # etcd, not anyone's guess, decided it was gone
    assert after.epoch == first.epoch + 1
    assert sum(s.run.leader.leading for s in sims) == 1


def test_etcd_writes_per_join_heartbeat_and_round(
    etcd_server: object, keys: JobKeys, sims: list[Sim]
) -> None:
    limits = RunLimits(min_nodes=3, max_nodes=3, last_call=5.0)
    sims += [Sim(etcd_server, keys, limits, port=4000 + i).join() for i in range(3)]
    # max_nodes reached with every slot ready: no need to settle for 5 s.
    world = wait_world(sims[0], lambda w: len(w.members) == 3, timeout=4.0)
    assert world.epoch == 1
    assert [s.run.node.writes for s in sims] == [1, 1, 1]  # a join is one put
    leader = next(s for s in sims if s.run.leader.leading)
    assert leader.run.leader.stats.cas_attempts == 1  # a round close is one CAS
    assert sum(s.run.leader.stats.election_attempts for s in sims) <= len(sims)
    revision = sims[0].client.snapshot(keys.root)[1]
    # Heartbeats: lease keep-alives only. Wait until etcd confirmed a keep-alive of every
    # node more than a TTL from now (each lease was kept alive past a whole TTL) ...
    since = time.monotonic()
    assert wait_for(lambda: all(s.run.node.lease.last_refreshed > since + TTL  # type: ignore[union-attr]
                                for s in sims), TTL + 30), "the leases were not kept alive"
    # ... and nothing was written meanwhile.
    assert sims[0].client.snapshot(keys.root)[1] == revision
    assert [s.run.node.writes for s in sims] == [1, 1, 1]


def test_a_finished_job_id_is_reused_at_once_and_with_linger_after_it(
    etcd_server: object, etcd_prefix: str
) -> None:
    client = client_for(etcd_server)
    base = JobKeys(etcd_prefix, "reuse")
    first = open_run(client, base)
    assert first.keys.generation == 1 and first.ended is None
    client.put(first.keys.store + "x", b"y")
    assert end_run(client, first.keys, EndRecord("finished", "done", 30), linger=2)
    assert not end_run(client, first.keys, EndRecord("failed", "late", 1), linger=2)
    assert client.get(first.keys.world) is None  # the run's state is gone
    end = client.get(first.keys.end)  # but for the store, which goes with the end record
    assert end is not None and end.lease != 0
    assert [(kv.value, kv.lease) for kv in client.get_prefix(first.keys.store)] == [
        (b"y", end.lease)]
    generation = client.get(base.generation_key)
    assert generation is not None and generation.lease != 0  # an ended run's record goes too

    late = open_run(client, base, linger=2)  # a replacement started as the job ended
    assert late.ended == EndRecord("finished", "done", 30)
    fresh = open_run(client, base)  # without linger (the default): a fresh run at once
    assert fresh.ended is None and fresh.keys.generation == 2
    assert client.get(first.keys.end) is None  # the old run's keys went with the start
    assert client.get_prefix(first.keys.store) == []
    generation = client.get(base.generation_key)
    assert generation is not None and generation.lease == 0


def test_an_evicted_worker_stays_out_until_its_agent_replaces_it(
    etcd_server: object, keys: JobKeys, sims: list[Sim]
) -> None:
    # max_nodes reached with every slot ready skips the settle: an evicted worker whose
    # record still says ready (its agent has not killed it yet) must not be let back in.
    limits = RunLimits(min_nodes=1, max_nodes=3, last_call=0.3)
    sims += [Sim(etcd_server, keys, limits, port=4000 + i).join() for i in range(3)]
    world = wait_world(sims[0], lambda w: len(w.members) == 3)
    laggard = sims[2]
    for sim in sims[:2]:  # every other worker waits for it in step 7's collective
        sim.run.update(waiting={"epoch": world.epoch, "step": 7, "workers": ["0.1"]})
    slow = f"{laggard.me}/0.1"
    after = wait_world(sims[0], lambda w: w.epoch > world.epoch)
    assert after.evicted == (slow,) and slow not in after.ranks()
    time.sleep(5 * limits.last_call)
    assert sims[0].run.world() == after, "the evicted worker was admitted again"
    laggard.run.update(workers=(WorkerSlot(0, 2, True, True, 0),))  # its replacement
    back = wait_world(sims[0], lambda w: f"{laggard.me}/0.2" in w.ranks())
    assert slow not in back.ranks()


def test_after_everyone_restarts_the_next_world_waits_for_the_new_incarnations(
    etcd_server: object, keys: JobKeys, sims: list[Sim]
) -> None:
    # Restart mode (workers not in-place capable). A node joins a running world of two: the
    # leader writes an empty "everyone restart" world; the records still show the old
    # incarnations ready (and running: a pid) until each agent has restarted its workers. A
    # world formed from them would be stale at once (a storm of restarts), even with every
    # node present; once every node shows a new incarnation that is not running yet (no pid),
    # the world is complete and written at once.
    limits = RunLimits(min_nodes=2, max_nodes=3, last_call=1.0)
    sims += [Sim(etcd_server, keys, limits, port=4000 + i).join() for i in range(2)]
    for sim in sims:
        sim.record = sim.record.with_changes(
            workers=(WorkerSlot(0, 1, True, False, 0),))
        sim.run.update(workers=sim.record.workers)
    first = wait_world(sims[0], lambda w: len(w.members) == 2 and w.mode == "restart")
    for index, sim in enumerate(sims):  # their agents started the workers the world named
        sim.run.update(workers=(WorkerSlot(0, 1, True, False, 100 + index),))
    late = Sim(etcd_server, keys, limits, port=4002)
    late.record = late.record.with_changes(workers=(WorkerSlot(0, 1, True, False, 0),))
    sims.append(late.join())
    empty = wait_world(sims[0], lambda w: w.epoch > first.epoch and not w.members)
    time.sleep(0.3)  # the agents are still restarting: no world of their old incarnations
    assert sims[0].run.world() == empty
    for sim in sims[:2]:  # each restarts its worker: incarnation 2
        sim.run.update(workers=(WorkerSlot(0, 2, True, False, 0),))
    full = wait_world(sims[0], lambda w: len(w.members) == 3)
    assert full.epoch == empty.epoch + 1
    assert sorted(w.split("/")[1] for w in full.ranks()) == ["0.1", "0.2", "0.2"]


def test_a_node_writes_its_record_again_after_someone_overwrote_it(
    etcd_server: object, keys: JobKeys, sims: list[Sim]
) -> None:
    a = Sim(etcd_server, keys, RunLimits(1, 2)).join()
    sims.append(a)
    key = keys.node(a.me)
    assert not a.run.node.repair()  # the key holds what it wrote: nothing to do
    a.client.put(key, b"\x80\x04 not a node record")
    assert a.run.node.repair()
    kv = a.client.get(key)
    assert kv is not None and NodeRecord.loads(kv.value, key) == a.run.node.record
    assert kv.lease == a.run.node.lease.id  # type: ignore[union-attr]
    # A deleted record is left alone: a peer that found this node dead deleted it.
    a.client.delete(key)
    assert not a.run.node.repair()
    assert a.client.get(key) is None
