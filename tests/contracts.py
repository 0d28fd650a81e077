"""Contract mixins: the same tests run against ``tests.fakes.FakeEtcd`` and a real etcd.

* ``EtcdClientContract`` pins the etcd semantics the fake reproduces for the unit tests
  (revisions, compare-and-swap, transactions, leases, prefix watches, waits); a subclass
  provides ``etcd`` (an :class:`~membership.etcd.EtcdClient` or a fake) and ``prefix``.
* ``StoreContract`` pins the parts of ``torch.distributed.Store`` that torch's agent uses
  (blocking get, add, compare_set, wait, check, delete_key, num_keys, multi_get/multi_set,
  PrefixStore); a subclass provides ``store``.

Each contract has two subclasses: ``tests/unit/elastic/test_fake_etcd.py`` and
``tests/unit/elastic/test_store.py`` (on the fake), ``tests/integration/etcd/test_contracts.py``
(on a real etcd). A contract test that fails on one side only is a fake that lies.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import DistStoreError, PrefixStore

from elastic.errors import EtcdUnavailableError
from membership.etcd import LeaseGoneError, WatchEvent

_WAIT = timedelta(seconds=10)


class EtcdClientContract:
    """What the rendezvous code needs of etcd, through :class:`~membership.etcd.EtcdClient`."""

    @pytest.fixture
    def etcd(self) -> Any:
        raise NotImplementedError

    @pytest.fixture
    def prefix(self) -> str:
        raise NotImplementedError

    def test_put_get_and_revisions(self, etcd: Any, prefix: str) -> None:
        first = etcd.put(f"{prefix}/a", b"1")
        kv = etcd.get(f"{prefix}/a")
        assert kv is not None and kv.value == b"1"
        assert kv.mod_revision == kv.create_revision == first
        second = etcd.put(f"{prefix}/a", b"2")
        kv = etcd.get(f"{prefix}/a")
        assert second > first
        assert (kv.value, kv.mod_revision, kv.create_revision) == (b"2", second, first)
        assert etcd.get(f"{prefix}/missing") is None

    def test_snapshot_is_sorted_by_key_and_holds_only_the_prefix(
        self, etcd: Any, prefix: str
    ) -> None:
        for key in ("b", "a", "c/d"):
            last = etcd.put(f"{prefix}/x/{key}", key.encode())
        etcd.put(f"{prefix}/y", b"outside")
        kvs, revision = etcd.snapshot(f"{prefix}/x/")
        assert [kv.key for kv in kvs] == [f"{prefix}/x/a", f"{prefix}/x/b", f"{prefix}/x/c/d"]
        assert revision > last
        assert etcd.get_prefix(f"{prefix}/x/") == kvs

    def test_get_many_keeps_the_order_asked_for(self, etcd: Any, prefix: str) -> None:
        etcd.put(f"{prefix}/m2", b"2")
        last = etcd.put(f"{prefix}/m1", b"1")
        values, revision = etcd.get_many_at([f"{prefix}/m1", f"{prefix}/gone", f"{prefix}/m2"])
        assert [kv.value if kv else None for kv in values] == [b"1", None, b"2"]
        assert revision >= last
        assert etcd.get_many([f"{prefix}/m2"])[0].value == b"2"

    def test_put_many_writes_every_key_in_one_revision(self, etcd: Any, prefix: str) -> None:
        revision = etcd.put_many([(f"{prefix}/p{i}", str(i).encode()) for i in range(3)])
        kvs = etcd.get_prefix(f"{prefix}/p")
        assert [kv.value for kv in kvs] == [b"0", b"1", b"2"]
        assert {kv.mod_revision for kv in kvs} == {revision}

    def test_cas_writes_only_on_a_matching_revision_and_returns_the_current_value(
        self, etcd: Any, prefix: str
    ) -> None:
        key = f"{prefix}/cas"
        won, kv = etcd.cas(key, b"first", None)
        assert won and kv is not None and kv.value == b"first"
        assert etcd.create(key, b"again") is False  # exists already
        lost, current = etcd.cas(key, b"second", kv.mod_revision + 1000)
        assert not lost and current == kv  # the failed compare reads the value back
        lost, current = etcd.cas(key, b"second", None)
        assert not lost and current == kv
        won, after = etcd.cas(key, b"second", kv.mod_revision)
        assert won and after is not None and after.value == b"second"
        assert after.create_revision == kv.create_revision
        assert after.mod_revision > kv.mod_revision
        assert etcd.cas(f"{prefix}/absent", b"x", 5) == (False, None)

    def test_cas_with_a_delete_range_is_one_transaction(self, etcd: Any, prefix: str) -> None:
        etcd.put(f"{prefix}/old/1", b"1")
        etcd.put(f"{prefix}/old/2", b"2")
        etcd.put(f"{prefix}/older", b"kept")  # outside [old/, old0)
        seen: list[WatchEvent] = []
        watch = etcd.watch_prefix(f"{prefix}/", on_change=seen.extend)
        try:
            del seen[:]  # the first snapshot (see the watch test)
            won, kv = etcd.cas(f"{prefix}/new", b"n", None,
                               delete_range=(f"{prefix}/old/", f"{prefix}/old0"))
            assert won and kv is not None
            assert watch.wait_for(lambda m: f"{prefix}/old/2" not in m
                                  and f"{prefix}/new" in m, _WAIT)
            assert [kv.key for kv in etcd.get_prefix(f"{prefix}/")] == [
                f"{prefix}/new", f"{prefix}/older"]
            # One revision for the put and both deletes, as one transaction gives.
            assert {e.revision for e in seen} == {kv.mod_revision}
            assert sorted((e.type, e.key) for e in seen) == [
                ("DELETE", f"{prefix}/old/1"), ("DELETE", f"{prefix}/old/2"),
                ("PUT", f"{prefix}/new")]
        finally:
            watch.cancel()
        with pytest.raises(EtcdUnavailableError, match="duplicate key given in txn request"):
            etcd.cas(f"{prefix}/d/k", b"x", None, delete_range=(f"{prefix}/d/", f"{prefix}/d0"))

    def test_a_fenced_cas_writes_only_while_the_fence_key_is_the_same_incarnation(
        self, etcd: Any, prefix: str
    ) -> None:
        leader, world = f"{prefix}/leader", f"{prefix}/world"
        lease = etcd.grant_lease(30)
        won, term = etcd.cas(leader, b"a", None, lease=lease)
        assert won and term is not None
        won, kv = etcd.cas(world, b"1", None, fence=(leader, term.create_revision))
        assert won and kv is not None and kv.value == b"1"
        etcd.revoke_lease(lease)  # the term ends with its lease
        lost, current = etcd.cas(world, b"stale", kv.mod_revision,
                                 fence=(leader, term.create_revision))
        assert not lost and current == kv  # the world compare alone would have held
        # A new election of the same name is a new term: the old one's fence fails.
        assert etcd.create(leader, b"a")
        lost, current = etcd.cas(world, b"stale", kv.mod_revision,
                                 fence=(leader, term.create_revision))
        assert not lost and current == kv
        assert etcd.get(world).value == b"1"

    def test_delete_counts_what_it_removed(self, etcd: Any, prefix: str) -> None:
        etcd.put(f"{prefix}/d/1", b"1")
        etcd.put(f"{prefix}/d/2", b"2")
        etcd.put(f"{prefix}/e", b"3")
        assert etcd.delete(f"{prefix}/d/1") == 1
        assert etcd.delete(f"{prefix}/d/1") == 0
        assert etcd.delete_prefix(f"{prefix}/d/") == 1
        assert [kv.key for kv in etcd.get_prefix(f"{prefix}/")] == [f"{prefix}/e"]

    def test_a_revoked_lease_takes_its_keys_with_it(self, etcd: Any, prefix: str) -> None:
        lease = etcd.grant_lease(30)
        etcd.put(f"{prefix}/leased", b"x", lease=lease)
        etcd.put(f"{prefix}/free", b"y")
        kv = etcd.get(f"{prefix}/leased")
        assert kv is not None and kv.lease == lease
        assert etcd.keep_alive_once(lease) > 0
        etcd.revoke_lease(lease)
        assert etcd.get(f"{prefix}/leased") is None
        assert etcd.get(f"{prefix}/free") is not None
        assert etcd.keep_alive_once(lease) <= 0
        etcd.revoke_lease(lease)  # revoking twice is no error
        # The error the node's rejoin acts on (membership.node): the lease is gone.
        with pytest.raises(LeaseGoneError, match="no longer holds lease"):
            etcd.put(f"{prefix}/late", b"z", lease=lease)

    def test_a_prefix_put_on_a_lease_keeps_its_values_and_goes_with_the_lease(
        self, etcd: Any, prefix: str
    ) -> None:
        etcd.put(f"{prefix}/s/a", b"1")
        etcd.put(f"{prefix}/s/b", b"2")
        etcd.put(f"{prefix}/t", b"outside")
        lease = etcd.grant_lease(30)
        assert etcd.attach_prefix_to_lease(f"{prefix}/s/", lease) == 2
        kvs = etcd.get_prefix(f"{prefix}/s/")
        assert [(kv.key[-1], kv.value, kv.lease) for kv in kvs] == [
            ("a", b"1", lease), ("b", b"2", lease)]
        assert etcd.attach_prefix_to_lease(f"{prefix}/none/", lease) == 0
        etcd.revoke_lease(lease)
        assert etcd.get_prefix(f"{prefix}/s/") == []
        outside = etcd.get(f"{prefix}/t")
        assert outside is not None and outside.lease == 0

    def test_a_prefix_watch_mirrors_puts_and_deletes_in_revision_order(
        self, etcd: Any, prefix: str
    ) -> None:
        etcd.put(f"{prefix}/w/before", b"0")
        batches: list[Sequence[WatchEvent]] = []
        watch = etcd.watch_prefix(f"{prefix}/w/", on_change=batches.append)
        try:
            # The first snapshot: in items() at once, and reported to on_change (from the
            # constructor) as PUT events at the snapshot's revision.
            assert set(watch.items()) == {f"{prefix}/w/before"}
            assert [[(e.type, e.key, e.revision) for e in b] for b in batches] == [
                [("PUT", f"{prefix}/w/before", watch.revision)]]
            del batches[:]
            lease = etcd.grant_lease(30)
            r1 = etcd.put(f"{prefix}/w/a", b"1", lease=lease)
            r2 = etcd.put(f"{prefix}/w/a", b"2")
            etcd.put(f"{prefix}/other", b"not watched")
            r3 = etcd.put(f"{prefix}/w/b", b"3", lease=lease)
            etcd.revoke_lease(lease)  # b goes with it (a was rewritten without the lease)
            assert etcd.delete(f"{prefix}/w/before") == 1
            assert watch.wait_for(lambda m: set(m) == {f"{prefix}/w/a"}, _WAIT), watch.items()
            events = [e for batch in batches for e in batch]
            assert [(e.type, e.key.removeprefix(prefix)) for e in events] == [
                ("PUT", "/w/a"), ("PUT", "/w/a"), ("PUT", "/w/b"), ("DELETE", "/w/b"),
                ("DELETE", "/w/before")]
            assert [e.revision for e in events[:3]] == [r1, r2, r3]
            assert events == sorted(events, key=lambda e: e.revision)
            assert events[1].kv is not None and events[1].kv.value == b"2"
            assert events[3].kv is None
            assert watch.items()[f"{prefix}/w/a"].value == b"2"
            assert watch.revision == events[-1].revision
        finally:
            watch.cancel()

    def test_wait_for_keys_wakes_when_another_thread_writes_and_times_out_naming_keys(
        self, etcd: Any, prefix: str
    ) -> None:
        etcd.put(f"{prefix}/k1", b"1")
        timer = threading.Timer(0.2, etcd.put, args=(f"{prefix}/k2", b"2"))
        timer.start()
        try:
            kvs = etcd.wait_for_keys([f"{prefix}/k2", f"{prefix}/k1"], _WAIT)
        finally:
            timer.cancel()
        assert [kv.value for kv in kvs] == [b"2", b"1"]
        with pytest.raises(TimeoutError, match=(
                rf"^timed out after 0\.3 s waiting for etcd keys \['{prefix}/k3'\]$")):
            etcd.wait_for_keys([f"{prefix}/k1", f"{prefix}/k3"], timedelta(seconds=0.3))


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
