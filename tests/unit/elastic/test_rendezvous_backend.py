"""The etcd rendezvous backend's contract on the in-memory fake, plus fake-only failure cases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from elastic.errors import ConfigError, EtcdUnavailableError
from elastic.rendezvous import STATE_MAGIC, EtcdV3RendezvousBackend
from tests.contracts import RendezvousBackendContract
from tests.fakes import FakeEtcd, fake_client


@pytest.fixture
def fake() -> FakeEtcd:
    return FakeEtcd()


class TestBackendOnFakeEtcd(RendezvousBackendContract):
    @pytest.fixture
    def backend(self, fake: FakeEtcd) -> Any:
        return EtcdV3RendezvousBackend(fake_client(fake), "job", key_prefix="/t")

    @pytest.fixture
    def corrupt_state(self, backend: Any, fake: FakeEtcd) -> Callable[[], None]:
        return lambda: fake.corrupt(backend.key, b"\x80\x04garbage")


def test_state_key_follows_the_documented_keyspace(fake: FakeEtcd) -> None:
    backend = EtcdV3RendezvousBackend(fake_client(fake), "job-7", key_prefix="/elastic/")
    backend.set_state(b"s")
    assert backend.key == "/elastic/job-7/rdzv/state"
    stored = fake.get(backend.key)
    assert stored is not None and stored.value == STATE_MAGIC + b"s"


def test_state_is_written_under_a_long_lease_that_expires_with_the_last_agent(
    fake: FakeEtcd,
) -> None:
    backend = EtcdV3RendezvousBackend(fake_client(fake), "job", state_ttl=60)
    backend.set_state(b"s")
    stored = fake.get(backend.key)
    assert stored is not None and stored.lease in fake.lease_ids()
    backend.close()
    fake.advance(61)
    assert backend.get_state() is None


def test_state_ttl_zero_keeps_the_state_forever(fake: FakeEtcd) -> None:
    backend = EtcdV3RendezvousBackend(fake_client(fake), "job", state_ttl=0)
    backend.set_state(b"s")
    fake.advance(10**6)
    assert backend.get_state() is not None


def test_a_lost_state_lease_is_replaced_and_the_write_still_happens(fake: FakeEtcd) -> None:
    backend = EtcdV3RendezvousBackend(fake_client(fake), "job", state_ttl=60)
    backend.set_state(b"a")
    stored = fake.get(backend.key)
    assert stored is not None
    fake.expire_lease(stored.lease)  # also deletes the key, as etcd does
    state, _, has_set = backend.set_state(b"b")
    assert (state, has_set) == (b"b", True)


@pytest.mark.parametrize("run_id", ["", "a/b"])
def test_a_bad_run_id_is_a_one_sentence_error(fake: FakeEtcd, run_id: str) -> None:
    with pytest.raises(ConfigError, match=r"^the job id \(.*\) must be non-empty and contain no "
                                          r"'/'; pass --job-id\.$"):
        EtcdV3RendezvousBackend(fake_client(fake), run_id)


def test_an_unreachable_etcd_surfaces_as_etcd_unavailable(fake: FakeEtcd) -> None:
    backend = EtcdV3RendezvousBackend(fake_client(fake), "job")
    fake.down = True
    with pytest.raises(EtcdUnavailableError, match=r"fake-etcd:2379"):
        backend.get_state()


def test_torchs_event_names_come_from_the_cheap_frame_walk_with_the_same_answer() -> None:
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from elastic import _rdzv_backend

    def torchs_own(depth: int = 2) -> str:  # torch 2.13's get_method_name, verbatim
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    def record(how: object) -> str:  # shaped like torch's _record(): the name of its caller
        return how()  # type: ignore[operator, no-any-return]

    def keep_alive(how: object) -> str:
        return record(how)

    assert dynamic_rendezvous.get_method_name is _rdzv_backend.frame_function_name
    assert keep_alive(_rdzv_backend.frame_function_name) == keep_alive(torchs_own) == "keep_alive"
    assert _rdzv_backend.frame_function_name(10_000) == "no_method_name"
