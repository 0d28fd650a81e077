"""The etcd client against a real etcd server on loopback: failures, restarts, leases (the
client's and the store's contracts are in test_contracts.py, the membership protocol's tests in
test_rdzv_protocol.py)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import requests

from elastic.errors import ConfigError, EtcdUnavailableError
from launch.etcd_server import EmbeddedEtcd, EtcdBinaryNotFoundError, find_etcd_binary
from membership.etcd import EtcdClient, EtcdConfig, Lease, keep_alive_period, parse_endpoints
from membership.silent_peers import lease_unrefreshed
from tests.support.etcd_required import etcd_binary
from tests.support.fault_proxy import FaultProxy

pytestmark = pytest.mark.etcd


def _client(endpoint: str, deadline: float = 5.0) -> EtcdClient:
    return EtcdClient(EtcdConfig(
        endpoints=(endpoint,), request_timeout=timedelta(seconds=1),
        deadline=timedelta(seconds=deadline),
    ))


@pytest.fixture
def client(etcd_server: Any) -> EtcdClient:
    return _client(etcd_server.endpoint)


def test_lease_keys_vanish_when_the_lease_is_revoked(client: EtcdClient, etcd_prefix: str) -> None:
    lease = Lease(client, ttl=2)
    granted = time.monotonic()
    client.put(etcd_prefix + "/member", b"x", lease=lease.id)
    # Until etcd confirmed a keep-alive sent more than a TTL after the grant: without the
    # keep-alive thread, the key would be gone by then.
    deadline = granted + 30
    while lease.last_refreshed <= granted + lease.ttl and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lease.last_refreshed > granted + lease.ttl and not lease.lost.is_set()
    assert client.get(etcd_prefix + "/member") is not None
    lease.revoke()
    assert client.get(etcd_prefix + "/member") is None


def test_unparsable_endpoint_is_a_one_sentence_error() -> None:
    with pytest.raises(ConfigError, match=r"^etcd endpoint \('nohost'\) is not host:port; "):
        parse_endpoints("127.0.0.1:2379,nohost")


def test_unreachable_etcd_fails_within_the_deadline_naming_the_endpoint() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=rf"^etcd \(127\.0\.0\.1:{port}\) did not "):
        _client(f"127.0.0.1:{port}", deadline=1.0).get("/x")
    # The design: the deadline (1 s) plus one request's timeout (1 s). 30 s tells that from
    # retrying on and on, with room for a loaded 2-core machine.
    assert time.monotonic() - start < 30


def test_missing_binary_error_says_how_to_install_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("ELASTIC_ETCD_BINARY", raising=False)
    with pytest.raises(EtcdBinaryNotFoundError, match=r"^etcd binary not found on PATH; install"):
        find_etcd_binary()


@pytest.fixture
def binary() -> str:
    """The etcd binary for tests that start (and kill) an etcd of their own."""
    return etcd_binary()


def test_client_recovers_after_etcd_is_killed_and_restarted(tmp_path: Any, binary: str) -> None:
    with EmbeddedEtcd(binary=binary, data_dir=str(tmp_path / "data")) as server:
        client = _client(server.endpoint, deadline=20)
        client.put("/k", b"before")
        server.kill()
        with pytest.raises(EtcdUnavailableError):
            _client(server.endpoint, deadline=0.5).get("/k")
        server.start()
        assert client.get("/k") is not None and client.get("/k").value == b"before"  # type: ignore[union-attr]


def test_a_stopped_etcd_makes_calls_time_out_instead_of_hanging(binary: str) -> None:
    with EmbeddedEtcd(binary=binary) as server:
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(EtcdUnavailableError):
                _client(server.endpoint, deadline=1.0).get("/k")
            # The design: the deadline (1 s) plus one request's timeout (1 s); a client
            # without timeouts would hang here until the test's own timeout. 30 s tells the
            # two apart with room for a loaded 2-core machine.
            assert time.monotonic() - start < 30
        finally:
            os.kill(server.pid, signal.SIGCONT)


def test_client_fails_over_to_the_next_endpoint(etcd_server: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    client = EtcdClient(EtcdConfig(endpoints=(dead, etcd_server.endpoint),
                                   request_timeout=timedelta(seconds=1)))
    client.put("/failover", b"ok")
    assert client.get("/failover") is not None


def test_a_failed_watch_resumes_once_etcd_answers_and_reports_what_changed(
        tmp_path: Any, binary: str) -> None:
    with EmbeddedEtcd(binary=binary, data_dir=str(tmp_path / "data")) as server:
        writer = _client(server.endpoint, deadline=20)
        writer.put("/w/gone", b"1")
        writer.put("/w/kept", b"1")
        seen: list[tuple[str, str]] = []
        watch = _client(server.endpoint, deadline=1.0).watch_prefix(
            "/w/", on_change=lambda events: seen.extend((e.type, e.key) for e in events))
        watch.resume()  # not failed: a no-op
        server.kill()
        assert watch.failed.wait(30), "the watch never gave up"
        assert watch.error is not None
        with pytest.raises(EtcdUnavailableError):
            watch.resume()  # etcd is still down: the watch stays failed
        assert watch.failed.is_set()
        server.start()
        writer.delete("/w/gone")
        writer.put("/w/new", b"2")
        watch.resume()
        assert not watch.failed.is_set() and watch.error is None
        assert set(watch.items()) == {"/w/kept", "/w/new"}
        assert ("DELETE", "/w/gone") in seen and ("PUT", "/w/new") in seen
        writer.put("/w/later", b"3")  # followed again by the new thread
        assert watch.wait_for(lambda mirror: "/w/later" in mirror, timedelta(seconds=10))
        watch.cancel()
        with pytest.raises(RuntimeError, match=r"was cancelled; it cannot resume\.$"):
            watch.resume()


def test_a_lease_reads_as_unrefreshed_only_once_a_keep_alive_period_has_passed(
    client: EtcdClient,
) -> None:
    # The silent-peer check's etcd half (membership.silent_peers): a lease refreshed within the
    # last keep-alive period is fresh; one left alone for longer is not; a revoked one is gone.
    lease_id = client.grant_lease(3)
    assert client.lease_time_to_live(lease_id)[1] == 3
    assert not lease_unrefreshed(client, lease_id)
    time.sleep(keep_alive_period(3) + 0.1)
    assert lease_unrefreshed(client, lease_id)
    client.keep_alive_once(lease_id)
    assert not lease_unrefreshed(client, lease_id)
    client.revoke_lease(lease_id)
    assert client.lease_time_to_live(lease_id)[0] == -1
    assert lease_unrefreshed(client, lease_id)


def _compact(endpoint: str, revision: int) -> None:
    """Compacts etcd's history up to ``revision`` (what etcd's auto-compaction does)."""
    reply = requests.post(f"http://{endpoint}/v3/kv/compaction",
                          json={"revision": str(revision), "physical": True}, timeout=10)
    reply.raise_for_status()


def test_a_watch_that_reconnects_after_a_compaction_resyncs_and_reports_what_it_missed(
    etcd_server: Any, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = _client(etcd_server.endpoint)
    host, port = etcd_server.endpoint.rsplit(":", 1)
    prefix = f"{etcd_prefix}/w/"
    writer.put(prefix + "gone", b"1")
    writer.put(prefix + "kept", b"1")
    seen: list[tuple[str, str]] = []
    with FaultProxy(host, int(port)) as proxy:
        watch = _client(proxy.endpoint, deadline=30).watch_prefix(
            prefix, on_change=lambda events: seen.extend((e.type, e.key) for e in events))
        try:
            # The watch's connection breaks; while it cannot reconnect, the prefix changes
            # and etcd compacts its history past the revision the watch would resume from.
            proxy.reset()
            assert proxy.wait_for_fault(10)
            writer.delete(prefix + "gone")
            writer.put(prefix + "new", b"2")
            revision = writer.put(f"{etcd_prefix}/elsewhere", b"x")
            _compact(etcd_server.endpoint, revision)
            with caplog.at_level(logging.INFO, logger="membership._etcd_watch"):
                proxy.heal()
                # Resumed from a compacted revision, the watch reads a fresh snapshot and
                # reports the difference from its mirror.
                assert watch.wait_for(lambda m: set(m) == {prefix + "kept", prefix + "new"},
                                      timedelta(seconds=20)), watch.items()
            assert "fell behind compaction; resyncing" in caplog.text
            assert not watch.failed.is_set()
            assert ("DELETE", prefix + "gone") in seen and ("PUT", prefix + "new") in seen
            writer.put(prefix + "later", b"3")  # and it follows again
            assert watch.wait_for(lambda m: prefix + "later" in m, timedelta(seconds=10))
        finally:
            watch.cancel()
