"""``config_from_env`` and the classification of TLS failures, without a running etcd."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from elastic import env
from elastic.errors import ConfigError
from membership.etcd import EtcdConfig, _tls_refusal, config_from_env


@pytest.fixture
def pem(tmp_path: Path) -> str:
    path = tmp_path / "x.pem"
    path.write_text("not checked here")
    return str(path)


@pytest.fixture(autouse=True)
def _no_etcd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (env.ETCD_CA_CERT, env.ETCD_CERT, env.ETCD_KEY, env.ETCD_USERNAME,
                 env.ETCD_PASSWORD):
        monkeypatch.delenv(name, raising=False)


def test_tls_files_and_credentials_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, pem: str
) -> None:
    monkeypatch.setenv(env.ETCD_CA_CERT, pem)
    monkeypatch.setenv(env.ETCD_USERNAME, "trainer")
    monkeypatch.setenv(env.ETCD_PASSWORD, "s3cr3t-pw")
    config = config_from_env("a:1,b:2")
    assert config.endpoints == ("a:1", "b:2")
    assert (config.protocol, config.ca_cert, config.username, config.password) == (
        "https", pem, "trainer", "s3cr3t-pw")
    assert "s3cr3t-pw" not in repr(config)


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch, pem: str) -> None:
    monkeypatch.setenv(env.ETCD_CA_CERT, "/nonexistent/ca.pem")
    config = config_from_env("a:1", ca_cert=pem, protocol="http")
    assert (config.ca_cert, config.protocol) == (pem, "http")


def test_plain_http_without_tls_files() -> None:
    assert config_from_env("a:1").protocol == "http"


def test_a_missing_tls_file_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.ETCD_CERT, "/nonexistent/client.pem")
    with pytest.raises(ConfigError, match=r"client certificate \(/nonexistent/client.pem\) is "
                                          r"not a file; point ELASTIC_ETCD_CERT at a PEM file"):
        config_from_env("a:1")


def _ssl_error(text: str) -> requests.exceptions.SSLError:
    return requests.exceptions.SSLError(f"HTTPSConnectionPool(host='h', port=1): Max retries "
                                        f"exceeded (Caused by SSLError({text!r}))")


_CONFIG = EtcdConfig(endpoints=("h:1",), ca_cert="/ca.pem")


def test_an_untrusted_server_certificate_is_final_and_names_the_ca() -> None:
    message = _tls_refusal("https://h:1", _ssl_error(
        "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local "
        "issuer certificate (_ssl.c:1006)"), _CONFIG)
    assert message == (
        "etcd (https://h:1) presented a server certificate that /ca.pem does not trust "
        "(certificate verify failed: unable to get local issuer certificate); point "
        "ELASTIC_ETCD_CA_CERT at the CA that signed etcd's certificate."
    )


def test_a_refused_client_certificate_is_final() -> None:
    message = _tls_refusal("https://h:1", _ssl_error(
        "[SSL: SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad certificate (_ssl.c:1006)"), _CONFIG)
    assert message is not None
    assert message.startswith("etcd (https://h:1) refused this client's TLS certificate (none "
                              "was given: sslv3 alert bad certificate); set ELASTIC_ETCD_CERT")


@pytest.mark.parametrize("error", [
    requests.exceptions.ConnectionError("connection refused"),
    _ssl_error("[SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol "
               "(_ssl.c:1006)"),
])
def test_other_failures_stay_retryable(error: requests.RequestException) -> None:
    assert _tls_refusal("https://h:1", error, _CONFIG) is None
