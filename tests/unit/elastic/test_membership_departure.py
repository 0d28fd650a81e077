"""Planned departures in the membership registry and the handler, on the in-memory fake."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic.handler import ElasticRendezvousHandler
from elastic.membership import MembershipRegistry, read_job_status
from elastic.rendezvous import EtcdV3RendezvousBackend
from elastic.store import EtcdV3Store
from tests.fakes import FakeEtcd, fake_client

WAIT = timedelta(seconds=10)


def _registry(fake: FakeEtcd) -> MembershipRegistry:
    return MembershipRegistry(fake_client(fake), "job", key_prefix="/e")


def _wait(predicate: object, what: str) -> None:
    deadline = time.monotonic() + WAIT.total_seconds()
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_announced_departure_is_known_before_the_lease_goes_and_stays_known() -> None:
    fake = FakeEtcd()
    survivor, leaving = _registry(fake), _registry(fake)
    leaving.register(2, 1, 2)
    survivor.register(2, 0, 2)
    assert survivor.departing_members() == frozenset()

    assert leaving.announce_departure({"source": "aws", "deadline": None})

    _wait(lambda: survivor.departing_members() == {1}, "the departure note")
    assert survivor.lost_members() == frozenset()  # still a member until it leaves
    kv = fake.get("/e/job/members/2/1")
    assert kv is not None and json.loads(kv.value)["departing"] == {"source": "aws",
                                                                    "deadline": None}
    status = read_job_status(fake_client(fake), "job", key_prefix="/e")
    assert status is not None and status.members[1].departing == {"source": "aws",
                                                                  "deadline": None}

    leaving.close()
    _wait(lambda: survivor.lost_members() == {1}, "the revoked lease")
    assert survivor.departing_members() == {1}
    survivor.register(3, 0, 1)  # a new round starts with a clean slate
    assert survivor.departing_members() == frozenset()
    survivor.close()


def test_a_node_without_a_member_key_has_nothing_to_announce() -> None:
    assert not _registry(FakeEtcd()).announce_departure({"source": "gcp"})


@pytest.fixture(autouse=True)
def _no_shared_tcp_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _handler(fake: FakeEtcd, addr: str) -> ElasticRendezvousHandler:
    client = fake_client(fake)
    backend = EtcdV3RendezvousBackend(client, "job", key_prefix="/e")
    inner = DynamicRendezvousHandler.from_backend(
        run_id="job", store=EtcdV3Store(client, "/e/job/store/"), backend=backend,
        min_nodes=1, max_nodes=2, local_addr=addr,
        timeout=RendezvousTimeout(join=timedelta(seconds=30), last_call=timedelta(seconds=0.1),
                                  heartbeat=timedelta(seconds=5)),
        keep_alive_interval=1, keep_alive_max_attempt=60,
    )
    registry = MembershipRegistry(client, "job", key_prefix="/e", member_ttl=60)
    return ElasticRendezvousHandler(inner, registry, backend=backend)


def test_leaving_removes_the_node_from_torchs_round_without_closing_the_rendezvous() -> None:
    fake = FakeEtcd()
    handler = _handler(fake, "node-a")
    handler.next_rendezvous()
    state = handler.inner._state_holder.state  # type: ignore[attr-defined]
    assert len(state.participants) == 1

    handler.leave(WAIT)

    # Pins the private torch hooks leave() uses: the round advanced without waiting for the
    # 60 s heartbeat timeout, and nobody closed the rendezvous.
    handler.inner._state_holder.sync()  # type: ignore[attr-defined]
    state = handler.inner._state_holder.state  # type: ignore[attr-defined]
    assert state.participants == {} and not state.complete and state.round == 1
    assert not state.closed and not handler.is_closed()
    assert fake.get_prefix("/e/job/members/") == []  # member lease revoked at once

    other = _handler(fake, "node-b")
    info = other.next_rendezvous()
    assert (info.world_size, other.round) == (1, 1)
    assert other.shutdown()
