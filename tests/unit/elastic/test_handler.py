"""ElasticRendezvousHandler over torch's DynamicRendezvousHandler, on the in-memory fake."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic.errors import ConfigError
from elastic.handler import ElasticRendezvousHandler
from elastic.membership import MembershipRegistry
from elastic.rendezvous import EtcdV3RendezvousBackend, create_rdzv_handler, torchrun_handler
from elastic.store import EtcdV3Store
from tests.fakes import FakeEtcd, fake_client

WAIT = timedelta(seconds=10)


@pytest.fixture(autouse=True)
def _no_shared_tcp_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without this torch's handler opens a TCPStore server on "node-a", which never resolves;
    # create_rdzv_handler sets the same variable for real jobs.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _handler(fake: FakeEtcd, *, min_nodes: int = 1, max_nodes: int = 1) -> ElasticRendezvousHandler:
    client = fake_client(fake)
    backend = EtcdV3RendezvousBackend(client, "job", key_prefix="/e")
    inner = DynamicRendezvousHandler.from_backend(
        run_id="job", store=EtcdV3Store(client, "/e/job/store/"), backend=backend,
        min_nodes=min_nodes, max_nodes=max_nodes, local_addr="node-a",
        timeout=RendezvousTimeout(join=timedelta(seconds=30),
                                  last_call=timedelta(seconds=0.1)),
        keep_alive_interval=1,
    )
    registry = MembershipRegistry(client, "job", key_prefix="/e", member_ttl=2)
    return ElasticRendezvousHandler(inner, registry, backend=backend)


def test_a_completed_round_registers_this_node_under_torchs_agreed_round() -> None:
    fake = FakeEtcd()
    handler = _handler(fake)
    info = handler.next_rendezvous()
    # Pins the private hook we read: torch's state holder exposes the agreed round number.
    assert isinstance(handler.inner._state_holder.state.round, int)  # type: ignore[attr-defined]
    assert (info.rank, info.world_size, handler.round) == (0, 1, 0)
    assert [kv.key for kv in fake.get_prefix("/e/job/members/")] == ["/e/job/members/0/0"]
    assert handler.get_backend() == "etcd-v3"
    assert handler.use_agent_store is False or handler.use_agent_store is True
    assert handler.shutdown()
    assert fake.get_prefix("/e/job/members/") == []  # left at once: lease revoked


def test_a_lost_member_counts_as_a_waiting_node() -> None:
    fake = FakeEtcd()
    handler = _handler(fake, min_nodes=1, max_nodes=2)
    handler.next_rendezvous()
    assert handler.num_nodes_waiting() == 0
    # A second member of the same round whose node then dies.
    lease = fake.grant_lease(2)
    fake.put("/e/job/members/0/1", b"{}", lease=lease)
    handler.registry.changed.clear()
    handler.registry._world = 2  # as if the round had been formed with two nodes
    deadline = time.monotonic() + WAIT.total_seconds()
    while 1 not in handler.registry._seen and time.monotonic() < deadline:  # the watch saw it
        time.sleep(0.01)
    fake.expire_lease(lease)
    assert handler.registry.wait_for_change(WAIT)
    assert handler.lost_members() == {1}
    assert handler.membership_changed()
    assert handler.num_nodes_waiting() == 1
    handler.shutdown()


def test_an_etcd_outage_while_registering_is_a_rendezvous_connection_error() -> None:
    fake = FakeEtcd()
    handler = _handler(fake)

    class _Down(MembershipRegistry):
        def register(self, *args: Any, **kwargs: Any) -> None:
            fake.down = True
            super().register(*args, **kwargs)

    handler._registry = _Down(fake_client(fake), "job", key_prefix="/e")
    with pytest.raises(RendezvousConnectionError, match=r"fake-etcd:2379"):
        handler.next_rendezvous()


def _params(**config: Any) -> RendezvousParameters:
    return RendezvousParameters(backend="elastic-etcd-v3", endpoint="127.0.0.1:1", run_id="job",
                                min_nodes=1, max_nodes=2, **config)


@pytest.mark.parametrize(("key", "value"), [("member_ttl", "soon"), ("last_call_timeout", "-1"),
                                            ("deadline", "0")])
def test_a_bad_rdzv_conf_value_is_a_one_sentence_error(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^--rdzv-conf {key} \('{value}'\) must be a positive "
                                          rf"number; pass e\.g\. {key}=\S+\.$"):
        create_rdzv_handler(_params(**{key: value}))


def test_an_unparsable_endpoint_is_a_one_sentence_error() -> None:
    params = RendezvousParameters(backend="etcd-v3", endpoint="etcd-host", run_id="job",
                                  min_nodes=1, max_nodes=1)
    with pytest.raises(ConfigError, match=r"^etcd endpoint \('etcd-host'\) is not host:port"):
        create_rdzv_handler(params)


def test_the_entry_point_returns_the_creator_without_side_effects() -> None:
    assert torchrun_handler() is create_rdzv_handler


def test_torchs_registry_knows_both_backend_names() -> None:
    from torch.distributed.elastic.rendezvous import registry

    names = set(registry.handler_registry._registry)  # type: ignore[attr-defined]
    assert {"etcd-v3", "elastic-etcd-v3"} <= names


@pytest.mark.parametrize(("max_nodes", "config", "period"), [
    (2, {}, 1), (32, {}, 1), (33, {}, 2), (128, {}, 4), (1000, {}, 32),
    (128, {"keep_alive_interval": "1"}, 1),  # an explicit value always wins
    (4, {"keep_alive_interval": "7"}, 7),
])
def test_the_heartbeat_period_scales_with_max_nodes_unless_given(
    max_nodes: int, config: dict[str, str], period: int
) -> None:
    from elastic.rendezvous import keep_alive_interval

    params = RendezvousParameters(backend="etcd-v3", endpoint="127.0.0.1:1", run_id="job",
                                  min_nodes=1, max_nodes=max_nodes, **config)
    assert keep_alive_interval(params) == period
