"""``tests.fakes.FakeEtcd`` held to the etcd contract (the same tests run on a real etcd in
``tests/integration/etcd/test_contracts.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.contracts import EtcdClientContract
from tests.fakes import FakeEtcd


class TestFakeEtcd(EtcdClientContract):
    @pytest.fixture
    def etcd(self) -> Any:
        return FakeEtcd()

    @pytest.fixture
    def prefix(self) -> str:
        return "/contract"
