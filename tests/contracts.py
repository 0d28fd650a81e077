"""Contract mixins: the same tests run against ``tests.fakes.FakeEtcd`` and a real etcd.

``RendezvousBackendContract`` ports torch's ``RendezvousBackendTestMixin``
(``test/distributed/elastic/rendezvous/rendezvous_backend_test.py``) to pytest: a subclass
provides the ``backend`` and ``corrupt_state`` fixtures. ``StoreContract`` pins the parts of
``torch.distributed.Store`` that torch's agent uses (blocking get, add, compare_set, wait,
check, delete_key, num_keys, multi_get/multi_set, PrefixStore); a subclass provides ``store``.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import DistStoreError, PrefixStore


class StoreContract:
    """What torch's agent needs from a ``torch.distributed.Store``."""

    @pytest.fixture
    def store(self) -> Any:
        raise NotImplementedError

    def test_set_then_get_returns_the_bytes(self, store: Any) -> None:
        store.set("a", "1")
        store.set("b", b"\x00\xff")
        assert store.get("a") == b"1"
        assert store.get("b") == b"\x00\xff"

    def test_get_blocks_until_another_thread_sets_the_key(self, store: Any) -> None:
        timer = threading.Timer(0.3, store.set, args=("late", "v"))
        timer.start()
        try:
            assert store.get("late") == b"v"
        finally:
            timer.cancel()

    def test_get_of_a_missing_key_raises_dist_store_error_after_the_timeout(
        self, store: Any
    ) -> None:
        store.set_timeout(timedelta(seconds=0.3))
        with pytest.raises(DistStoreError, match=r"^Timed out after 0\.3 s waiting for store "
                                                 r"keys \['never'\]"):
            store.get("never")

    def test_wait_returns_once_every_key_exists_and_times_out_otherwise(
        self, store: Any
    ) -> None:
        store.set("w1", "x")
        timer = threading.Timer(0.2, store.set, args=("w2", "y"))
        timer.start()
        store.wait(["w1", "w2"], timedelta(seconds=10))
        with pytest.raises(DistStoreError, match=r"\['w1', 'w3'\]"):
            store.wait(["w1", "w3"], timedelta(seconds=0.2))

    def test_add_counts_from_zero_and_is_atomic_across_threads(self, store: Any) -> None:
        assert store.add("n", 5) == 5

        def bump() -> None:
            for _ in range(10):
                store.add("n", 1)

        threads = [threading.Thread(target=bump) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert store.add("n", 0) == 45
        assert store.get("n") == b"45"

    def test_compare_set_follows_tcpstore_semantics(self, store: Any) -> None:
        assert store.compare_set("cs", "x", "y") == b"x"  # missing key, expected not empty
        assert not store.check(["cs"])
        assert store.compare_set("cs", "", "first") == b"first"  # missing key, expected empty
        assert store.compare_set("cs", "wrong", "z") == b"first"
        assert store.compare_set("cs", "first", "second") == b"second"
        assert store.get("cs") == b"second"

    def test_check_delete_key_and_num_keys(self, store: Any) -> None:
        assert store.num_keys() == 0
        store.set("k1", "1")
        store.set("k2", "2")
        assert store.check(["k1", "k2"]) and not store.check(["k1", "k3"])
        assert store.num_keys() == 2
        assert store.delete_key("k1") is True
        assert store.delete_key("k1") is False
        assert store.num_keys() == 1

    def test_multi_set_and_multi_get_round_trip(self, store: Any) -> None:
        store.multi_set(["m1", "m2", "m3"], ["a", b"b", "c"])
        assert store.multi_get(["m3", "m1", "m2"]) == [b"c", b"a", b"b"]

    def test_works_under_a_prefix_store_as_torch_agent_uses_it(self, store: Any) -> None:
        inner = PrefixStore("torchelastic/round1", store)
        inner.set("rank0", "host:1234")
        inner.multi_set(["x", "y"], ["1", "2"])
        assert inner.get("rank0") == b"host:1234"
        assert inner.multi_get(["x", "y"]) == [b"1", b"2"]
        assert inner.add("count", 2) == 2
        assert inner.check(["x"]) and not store.check(["x"])
        assert store.get("torchelastic/round1/rank0") == b"host:1234"

    def test_a_blocked_get_under_a_prefix_store_is_woken(self, store: Any) -> None:
        inner = PrefixStore("p", store)
        timer = threading.Timer(0.2, inner.set, args=("k", "v"))
        timer.start()
        assert inner.get("k") == b"v"
