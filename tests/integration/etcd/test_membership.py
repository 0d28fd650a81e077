"""Lease-based failure detection and the operator's status view, against a real etcd."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from elastic.etcd import EtcdClient, EtcdConfig
from elastic.membership import MembershipRegistry, read_job_status

pytestmark = pytest.mark.etcd


def _client(endpoint: str) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=(endpoint,), request_timeout=timedelta(seconds=1)))


def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_member_whose_lease_expires_is_reported_lost(
    etcd_server: Any, etcd_prefix: str
) -> None:
    survivor = MembershipRegistry(_client(etcd_server.endpoint), "job", key_prefix=etcd_prefix,
                                  member_ttl=1)
    victim = MembershipRegistry(_client(etcd_server.endpoint), "job", key_prefix=etcd_prefix,
                                member_ttl=1)
    try:
        survivor.register(0, 0, 2)
        victim.register(0, 1, 2)
        assert _wait(lambda: survivor.lost_members() == frozenset(), 2)
        time.sleep(1.0)  # both seen alive; now the victim stops refreshing (as if SIGKILLed)
        assert victim._lease is not None
        victim._lease._stop.set()
        assert _wait(lambda: survivor.lost_members() == frozenset({1}), 10)
    finally:
        survivor.close()
        victim.close()


def test_an_explicit_leave_is_seen_at_once_and_a_new_round_starts_clean(
    etcd_server: Any, etcd_prefix: str
) -> None:
    a = MembershipRegistry(_client(etcd_server.endpoint), "job", key_prefix=etcd_prefix)
    b = MembershipRegistry(_client(etcd_server.endpoint), "job", key_prefix=etcd_prefix)
    try:
        a.register(3, 0, 2)
        b.register(3, 1, 2)
        assert _wait(lambda: 1 in a._seen, 2)
        b.close()  # revokes the lease: no waiting for the TTL
        assert _wait(lambda: a.lost_members() == frozenset({1}), 2)
        a.register(4, 0, 1)
        assert a.lost_members() == frozenset() and a.round == 4
    finally:
        a.close()
        b.close()


def test_status_lists_the_newest_rounds_live_members(etcd_server: Any, etcd_prefix: str) -> None:
    client = _client(etcd_server.endpoint)
    assert read_job_status(client, "job", key_prefix=etcd_prefix) is None
    regs = [MembershipRegistry(client, "job", key_prefix=etcd_prefix) for _ in range(2)]
    try:
        regs[0].register(1, 0, 1)
        regs[0].register(2, 0, 2)
        regs[1].register(2, 1, 2)
        status = read_job_status(client, "job", key_prefix=etcd_prefix)
        assert status is not None
        assert (status.round, status.world_size) == (2, 2)
        assert [m.group_rank for m in status.members] == [0, 1]
    finally:
        for reg in regs:
            reg.close()
