"""A narrow, typed client for etcd's v3 API over its JSON gateway (``/v3/...``).

Why the gateway rather than gRPC: the ``etcd3`` gRPC client is unmaintained and breaks with
current protobuf; the JSON gateway is served by every etcd from 3.4 on and needs only
``requests``. Every call has a timeout, several endpoints are tried in turn, and transient
failures are retried by one tenacity policy that ends at a deadline, after which
:class:`~elastic.errors.EtcdUnavailableError` names the endpoints.

The gateway base64-encodes keys and values and sends int64 fields as JSON strings.
"""

from __future__ import annotations

import base64
import logging
import re
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

import requests
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from elastic.errors import ConfigError, EtcdUnavailableError

logger = logging.getLogger(__name__)

_ENDPOINT_RE: Final = re.compile(r"^(?:(https?)://)?([A-Za-z0-9.\-_]+|\[[0-9a-fA-F:]+\]):(\d{1,5})$")


def parse_endpoints(text: str) -> tuple[str, ...]:
    """Parses ``host:port[,host:port...]`` (an ``http(s)://`` scheme is allowed).

    Raises:
        ConfigError: naming the first endpoint that cannot be parsed.
    """
    endpoints = []
    for raw in text.split(","):
        item = raw.strip()
        match = _ENDPOINT_RE.match(item)
        if not match or not 0 < int(match.group(3)) < 65536:
            raise ConfigError(
                f"etcd endpoint ({item!r}) is not host:port; pass --etcd "
                "host:port[,host:port...]."
            )
        endpoints.append(item)
    return tuple(endpoints)


@dataclass(kw_only=True, slots=True, frozen=True)
class EtcdConfig:
    """How to reach etcd."""

    endpoints: tuple[str, ...]
    """``host:port`` client endpoints, tried in turn."""
    protocol: str = "http"
    """``http`` or ``https`` for endpoints given without a scheme."""
    request_timeout: timedelta = timedelta(seconds=5)
    """How long one HTTP request may take."""
    deadline: timedelta = timedelta(seconds=10)
    """How long a call may keep retrying transient failures before it gives up."""
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("no etcd endpoint given; pass --etcd host:port.")
        for name in ("request_timeout", "deadline"):
            value = getattr(self, name)
            if value <= timedelta(0):
                raise ConfigError(f"etcd {name} ({value}) must be positive.")


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd returned it."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


class _Transient(Exception):
    """A failure worth retrying on another endpoint or later."""


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return _b64(bytes(raw[: i + 1]))
    return _b64(b"\0")


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=base64.b64decode(item["key"]).decode(),
        value=base64.b64decode(item.get("value", "")),
        mod_revision=int(item.get("mod_revision", 0)),
        create_revision=int(item.get("create_revision", 0)),
        lease=int(item.get("lease", 0)),
    )


class EtcdClient:
    """Thread-safe etcd v3 client over the JSON gateway.

    Args:
        config: endpoints, timeouts, TLS and credentials.
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self._urls = [
            e if "://" in e else f"{config.protocol}://{e}" for e in config.endpoints
        ]
        self._current = 0
        self._lock = threading.Lock()
        self._session = requests.Session()
        self._session.trust_env = False  # proxies must never see etcd traffic
        if config.ca_cert:
            self._session.verify = config.ca_cert
        if config.cert:
            self._session.cert = (config.cert, config.key) if config.key else config.cert
        self._token: str | None = None

    def __repr__(self) -> str:
        return f"EtcdClient(endpoints={self.config.endpoints!r})"

    def _retrying(self) -> Retrying:
        return Retrying(
            stop=stop_after_delay(self.config.deadline.total_seconds()),
            wait=wait_exponential_jitter(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(_Transient),
            before_sleep=before_sleep_log(logger, logging.DEBUG),
            reraise=True,
        )

    def _post_once(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            index = self._current
        url = self._urls[index] + path
        headers = {"Authorization": self._token} if self._token else {}
        try:
            reply = self._session.post(
                url, json=payload, headers=headers,
                timeout=self.config.request_timeout.total_seconds(),
            )
        except requests.RequestException as exc:
            with self._lock:
                self._current = (index + 1) % len(self._urls)
            raise _Transient(str(exc)) from exc
        if reply.status_code in (401,) or (
            reply.status_code == 400 and "token" in reply.text and self.config.username
        ):
            self._authenticate()
            raise _Transient("auth token refreshed")
        if reply.status_code >= 500 or reply.status_code in (408, 429):
            with self._lock:
                self._current = (index + 1) % len(self._urls)
            raise _Transient(f"HTTP {reply.status_code}: {reply.text[:200]}")
        if reply.status_code != 200:
            raise EtcdUnavailableError(
                f"etcd ({url}) rejected the request with HTTP {reply.status_code} "
                f"({reply.text[:200].strip()}); check the credentials and the etcd version."
            )
        data: dict[str, Any] = reply.json()
        return data

    def _authenticate(self) -> None:
        if not self.config.username:
            return
        with self._lock:
            url = self._urls[self._current]
        reply = self._session.post(
            url + "/v3/auth/authenticate",
            json={"name": self.config.username, "password": self.config.password or ""},
            timeout=self.config.request_timeout.total_seconds(),
        )
        if reply.status_code != 200:
            raise EtcdUnavailableError(
                f"etcd ({url}) refused the credentials of user {self.config.username!r}; "
                "check the username and password."
            )
        self._token = str(reply.json()["token"])

    def call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POSTs ``payload`` to ``path`` with retries until the deadline.

        Raises:
            EtcdUnavailableError: when no endpoint answered within the deadline.
        """
        if self.config.username and self._token is None:
            for attempt in self._retrying():
                with attempt:
                    try:
                        self._authenticate()
                    except requests.RequestException as exc:
                        raise _Transient(str(exc)) from exc
        try:
            for attempt in self._retrying():
                with attempt:
                    return self._post_once(path, payload)
        except _Transient as exc:
            raise EtcdUnavailableError(
                f"etcd ({','.join(self.config.endpoints)}) did not answer within "
                f"{self.config.deadline.total_seconds():g} s ({exc}); check that etcd is running "
                "and reachable."
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, key: str) -> KeyValue | None:
        """Returns the key, or ``None`` if it does not exist."""
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Returns every key under ``prefix``, sorted by key."""
        reply = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return sorted((_kv(i) for i in reply.get("kvs", [])), key=lambda kv: kv.key)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Writes ``key``; returns the new revision."""
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            payload["lease"] = str(lease)
        return int(self.call("/v3/kv/put", payload)["header"]["revision"])

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int | None, *, lease: int = 0
    ) -> tuple[bool, KeyValue | None]:
        """Writes ``key`` only if its mod revision is ``expected_mod_revision``.

        ``None`` means "only if the key does not exist". One transaction: when the compare
        fails, its failure branch reads the current value, so a lost race costs no extra
        round trip.

        Returns:
            ``(written, current)``: ``current`` is the key after the transaction.
        """
        compare: dict[str, Any] = {"key": _b64(key), "result": "EQUAL"}
        if expected_mod_revision is None:
            compare.update(target="CREATE", create_revision="0")
        else:
            compare.update(target="MOD", mod_revision=str(expected_mod_revision))
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        reply = self.call("/v3/kv/txn", {
            "compare": [compare],
            "success": [{"request_put": put}, {"request_range": {"key": _b64(key)}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        })
        written = bool(reply.get("succeeded", False))
        responses = reply.get("responses", [])
        kvs = responses[-1].get("response_range", {}).get("kvs", []) if responses else []
        return written, (_kv(kvs[0]) if kvs else None)

    def delete(self, key: str) -> int:
        """Deletes ``key``; returns how many keys were deleted."""
        return int(self.call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key under ``prefix``."""
        reply = self.call(
            "/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _prefix_end(prefix)}
        )
        return int(reply.get("deleted", 0))

    def grant_lease(self, ttl: int) -> int:
        """Grants a lease of ``ttl`` seconds; returns its id."""
        return int(self.call("/v3/lease/grant", {"TTL": str(ttl)})["ID"])

    def keep_alive_once(self, lease_id: int) -> int:
        """Refreshes a lease; returns its remaining TTL (0 or less once it has expired)."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int(reply.get("result", {}).get("TTL", 0))

    def revoke_lease(self, lease_id: int) -> None:
        """Revokes a lease, deleting every key attached to it."""
        self.call("/v3/lease/revoke", {"ID": str(lease_id)})

    def close(self) -> None:
        """Closes the HTTP session."""
        self._session.close()


class Lease:
    """A lease kept alive by a daemon thread until :meth:`revoke` (or its owner's death).

    Args:
        client: the client to use.
        ttl: seconds etcd keeps the lease without a refresh.
    """

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        self._client = client
        self.ttl = ttl
        self.id = client.grant_lease(ttl)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease-{self.id:x}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        while not self._stop.wait(interval):
            try:
                if self._client.keep_alive_once(self.id) <= 0:
                    logger.warning("etcd lease %x expired", self.id)
                    self.lost.set()
                    return
            except Exception:  # keep trying until the lease is known lost or revoked
                logger.warning("keeping etcd lease %x alive failed", self.id, exc_info=True)

    def revoke(self) -> None:
        """Stops the keep-alive thread and revokes the lease (best effort)."""
        self._stop.set()
        try:
            self._client.revoke_lease(self.id)
        except Exception:  # the lease expires on its own within its TTL anyway
            logger.debug("revoking etcd lease %x failed", self.id, exc_info=True)
