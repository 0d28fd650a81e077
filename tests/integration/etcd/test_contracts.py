"""The contracts of ``tests/contracts.py`` on a real etcd: what keeps ``tests.fakes.FakeEtcd``
(the rendezvous unit tests' etcd) and the store's unit tests honest."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from membership.etcd import EtcdClient, EtcdConfig
from membership.store import EtcdV3Store
from tests.contracts import EtcdClientContract, StoreContract

pytestmark = pytest.mark.etcd


def _client(server: Any) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=(server.endpoint,),
                                 request_timeout=timedelta(seconds=2),
                                 deadline=timedelta(seconds=10)))


class TestRealEtcd(EtcdClientContract):
    @pytest.fixture
    def etcd(self, etcd_server: Any) -> Any:
        client = _client(etcd_server)
        yield client
        client.close()

    @pytest.fixture
    def prefix(self, etcd_prefix: str) -> str:
        return etcd_prefix


class TestStoreOnRealEtcd(StoreContract):
    @pytest.fixture
    def store(self, etcd_server: Any, etcd_prefix: str) -> Any:
        client = _client(etcd_server)
        yield EtcdV3Store(client, etcd_prefix + "/store", timeout=timedelta(seconds=30))
        client.close()
