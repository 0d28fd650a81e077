"""Runs of a job id over the fake etcd: reuse, the opt-in linger, and what a run leaves behind.

The same rules against a real etcd: ``tests/integration/etcd/test_rdzv_protocol.py`` and, with
real agents, ``tests/integration/test_launcher_late_node.py``.
"""

from __future__ import annotations

import pytest

from elastic.contract.records import EndRecord, GenerationRecord
from membership.generation import END_KEEP_S, GENERATION_KEEP_S, end_run, open_run
from membership.keys import JobKeys
from tests.fakes import FakeEtcd, fake_client

BASE = JobKeys("/t", "job")


@pytest.fixture
def etcd() -> FakeEtcd:
    return FakeEtcd()


def generation(etcd: FakeEtcd) -> GenerationRecord:
    kv = etcd.get(BASE.generation_key)
    assert kv is not None
    return GenerationRecord.loads(kv.value, kv.key)


def test_an_ended_run_is_followed_by_a_fresh_one_at_once_and_its_keys_are_gone(
    etcd: FakeEtcd,
) -> None:
    client = fake_client(etcd)
    first = open_run(client, BASE).keys
    assert first.generation == 1
    etcd.put(first.world, b"{}")
    etcd.put(first.store + "k", b"v")
    lease = etcd.grant_lease(3)
    etcd.put(first.node("a"), b"{}", lease=lease)  # a member still shutting down
    assert open_run(client, BASE).keys == first  # running: join it

    assert end_run(client, first, EndRecord("finished", "done", 9))
    assert not end_run(client, first, EndRecord("failed", "late", 1))  # ended once
    assert generation(etcd) == GenerationRecord(1, "finished")
    assert etcd.get(first.world) is None
    # The store stays with the end record (torchrun agents still in their exit barrier
    # read it), on the end record's lease.
    end = etcd.get(first.end)
    assert end is not None
    assert [(kv.value, kv.lease) for kv in etcd.get_prefix(first.store)] == [(b"v", end.lease)]

    again = open_run(client, BASE)  # the same id, right after: a fresh run
    assert again.ended is None and again.keys.generation == 2
    assert generation(etcd) == GenerationRecord(2)
    assert etcd.get_prefix(BASE.job_root) == [etcd.get(BASE.generation_key)]


def test_with_linger_a_late_node_gets_the_end_until_it_expires(etcd: FakeEtcd) -> None:
    client = fake_client(etcd)
    first = open_run(client, BASE, linger=5).keys
    assert end_run(client, first, EndRecord("failed", "boom", 3), linger=5)
    late = open_run(client, BASE, linger=5)
    assert late.ended == EndRecord("failed", "boom", 3) and late.keys == first
    etcd.advance(5)  # the end record's lease expires
    fresh = open_run(client, BASE, linger=5)
    assert fresh.ended is None and fresh.keys.generation == 2


def test_without_linger_the_end_record_stays_briefly_and_the_generation_for_a_day(
    etcd: FakeEtcd,
) -> None:
    client = fake_client(etcd)
    first = open_run(client, BASE).keys
    assert etcd.get(BASE.generation_key).lease == 0  # type: ignore[union-attr]  # running
    etcd.put(first.store + "k", b"v")
    end_run(client, first, EndRecord("finished", "done"))
    assert etcd.get(first.end) is not None and etcd.get(first.store + "k") is not None
    etcd.advance(END_KEEP_S)
    assert etcd.get(first.end) is None and etcd.get(first.store + "k") is None
    assert generation(etcd).state == "finished"
    etcd.advance(GENERATION_KEEP_S - END_KEEP_S)
    assert etcd.get_prefix(BASE.job_root) == []  # the id left nothing behind
    # Reused after that: run 1 again, and whatever an old run might have left is cleared.
    etcd.put(first.world, b"stale")
    assert open_run(client, BASE).keys.generation == 1
    assert etcd.get(first.world) is None
