"""Lease-based membership on the in-memory fake (real etcd: tests/integration/etcd)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from elastic.errors import ConfigError
from elastic.membership import MemberInfo, MembershipRegistry, read_job_status
from tests.fakes import FakeEtcd, fake_client

WAIT = timedelta(seconds=10)


@pytest.fixture
def fake() -> FakeEtcd:
    return FakeEtcd()


def _registry(fake: FakeEtcd, **kwargs: object) -> MembershipRegistry:
    return MembershipRegistry(fake_client(fake), "job", key_prefix="/e", **kwargs)  # type: ignore[arg-type]


def _lease_of(fake: FakeEtcd, key: str) -> int:
    kv = fake.get(key)
    assert kv is not None, key
    return kv.lease


def test_a_member_whose_lease_expires_is_reported_lost(fake: FakeEtcd) -> None:
    seen: list[frozenset[int]] = []
    survivor = _registry(fake, on_change=seen.append)
    victim = _registry(fake)
    victim.register(0, 1, 2)
    survivor.register(0, 0, 2)
    assert survivor.lost_members() == frozenset()
    survivor.changed.clear()

    fake.expire_lease(_lease_of(fake, "/e/job/members/0/1"))

    assert survivor.wait_for_change(WAIT)
    assert survivor.lost_members() == {1}
    assert survivor.membership_changed()
    assert seen[-1] == {1}
    survivor.close()
    victim.close()


def test_an_explicit_leave_is_seen_at_once_and_a_new_round_starts_clean(
    fake: FakeEtcd,
) -> None:
    a, b = _registry(fake), _registry(fake)
    a.register(3, 0, 2)
    b.register(3, 1, 2)
    a.changed.clear()
    b.close()
    assert a.wait_for_change(WAIT) and a.lost_members() == {1}
    a.register(4, 0, 1)
    assert a.round == 4 and a.lost_members() == frozenset()
    assert [kv.key for kv in fake.get_prefix("/e/job/members/")] == ["/e/job/members/4/0"]
    a.close()


def test_members_of_other_rounds_never_count_as_lost(fake: FakeEtcd) -> None:
    a, old = _registry(fake), _registry(fake)
    old.register(1, 1, 2)
    a.register(2, 0, 2)
    old.close()  # a member of round 1 leaving says nothing about round 2
    fake.put("/e/job/members/2/unparsable", b"{}")
    assert a.lost_members() == frozenset()
    a.close()


def test_losing_its_own_lease_tells_the_node_to_rejoin(fake: FakeEtcd) -> None:
    a = _registry(fake, member_ttl=1)
    a.register(0, 0, 1)
    assert not a.own_lease_lost()
    fake.expire_lease(_lease_of(fake, "/e/job/members/0/0"))
    assert a.wait_for_change(WAIT)
    assert a.own_lease_lost() and a.membership_changed()
    a.register(1, 0, 1)  # a new lease for the new round
    assert not a.own_lease_lost()
    assert _lease_of(fake, "/e/job/members/1/0") in fake.lease_ids()
    a.close()


def test_a_ttl_below_one_second_is_a_one_sentence_error(fake: FakeEtcd) -> None:
    with pytest.raises(ConfigError, match=r"^--rdzv-conf member_ttl \(0\) must be at least 1 "
                                          r"seconds\.$"):
        _registry(fake, member_ttl=0)


def test_status_reports_the_newest_rounds_live_members_with_ages(fake: FakeEtcd) -> None:
    def info(rank: int, world: int, started: float) -> bytes:
        return json.dumps({"group_rank": rank, "world_size": world, "host": "h", "pid": 1,
                           "started_at": started}).encode()

    fake.put("/elastic/job/members/1/0", info(0, 3, 100.0))
    fake.put("/elastic/job/members/2/1", info(1, 3, 200.0))
    fake.put("/elastic/job/members/2/0", info(0, 3, 150.0))
    fake.put("/elastic/job/members/2/9", b"not json")
    fake.put("/elastic/other/members/5/0", info(0, 1, 1.0))

    status = read_job_status(fake_client(fake), "job")

    assert status is not None
    assert (status.round, status.world_size, status.expected_size) == (2, 2, 3)
    assert [m.group_rank for m in status.members] == [0, 1]
    assert status.members[0].age(now=160.0) == pytest.approx(10.0)
    assert read_job_status(fake_client(fake), "missing") is None


def test_member_info_round_trips_through_json() -> None:
    info = MemberInfo(group_rank=2, world_size=3, host="n1", pid=42, started_at=1.5,
                      local_world_size=8)
    from dataclasses import asdict

    assert MemberInfo(**json.loads(json.dumps(asdict(info)))) == info
