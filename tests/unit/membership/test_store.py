"""EtcdV3Store's contract on the in-memory fake."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from elastic.errors import ConfigError
from membership.store import EtcdV3Store
from tests.contracts import StoreContract
from tests.fakes import FakeEtcd, fake_client


class TestStoreOnFakeEtcd(StoreContract):
    @pytest.fixture
    def store(self) -> Any:
        return EtcdV3Store(fake_client(FakeEtcd()), "/t/store", timeout=timedelta(seconds=30))


def test_keys_live_under_the_given_prefix() -> None:
    fake = FakeEtcd()
    store = EtcdV3Store(fake_client(fake), "/elastic/job/store")
    store.set("rank", "3")
    assert [kv.key for kv in fake.get_prefix("/elastic/")] == ["/elastic/job/store/rank"]


def test_add_on_a_non_integer_value_names_the_key() -> None:
    store = EtcdV3Store(fake_client(FakeEtcd()), "/t")
    store.set("k", "text")
    with pytest.raises(ValueError, match=r"^store key 'k' holds b'text', not an integer"):
        store.add("k", 1)


def test_a_non_positive_timeout_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^store timeout \(0:00:00\) must be positive\.$"):
        EtcdV3Store(fake_client(FakeEtcd()), "/t", timeout=timedelta(0))
