"""A narrow, typed client for etcd's v3 API over its JSON gateway (``/v3/...``).

This is the only module that speaks to etcd; everything else uses :class:`EtcdClient`.

Why ``requests`` on the gateway rather than a client library: the ``etcd3`` gRPC client is
unmaintained and breaks with current protobuf, and ``etcd3gw`` (the dependency the project
started with) is itself a thin wrapper over the same gateway that has no endpoint failover, no
user/password login, no supervised watches and no per-call timeout on its watch streams, so
wrapping it would mean re-implementing every call anyway. Talking to the gateway directly keeps
one HTTP session per client, an explicit timeout on every request (a SIGSTOPped etcd would
otherwise block forever), and lets a compare-and-swap return the current value in the same
round trip. The gateway is served by every etcd from 3.4 on.

Every call has a timeout, the endpoints are tried in turn, and transient failures are retried by
one tenacity policy (:data:`RETRY_POLICY`) that ends at the configured deadline, after which
:class:`~elastic.errors.EtcdUnavailableError` names the endpoints. Leases are kept alive by a
daemon thread (:class:`Lease`); prefix watches are supervised on daemon threads that reconnect
and resume (:class:`~membership._etcd_watch.PrefixWatch`).

Wire notes: the gateway base64-encodes keys and values and sends int64 fields as JSON strings.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, NoReturn

import requests
import requests.utils
import urllib3
from tenacity import (
    stop_after_delay,
)

from elastic import env
from elastic_errors import ConfigError, EtcdAccessError, EtcdUnavailableError
from membership._etcd_watch import PrefixWatch, WatchEvent, wait_for_keys
from membership._etcd_wire import (
    MAX_TXN_OPS,
    RETRY_POLICY,
    KeyValue,
    Transient,
    b64,
    decode_kv,
    prefix_range_end,
)

logger = logging.getLogger(__name__)

WATCH_IDLE_RECONNECT: Final = timedelta(seconds=10)
"""How long a watch stream may sit idle before it is re-opened (bounds how long a hung etcd
goes unnoticed); each idle watch therefore costs one new stream per this period."""


def keep_alive_period(ttl: int) -> float:
    """Seconds between two refreshes of a lease of ``ttl`` seconds (a third of the TTL, so two
    refreshes may fail before etcd drops it)."""
    return max(ttl / 3.0, 0.2)


_ENDPOINT_RE: Final = re.compile(
    r"^(?:(https?)://)?([A-Za-z0-9.\-_]+|\[[0-9a-fA-F:]+\]):(\d{1,5})/?$"
)


def parse_endpoints(text: str) -> tuple[str, ...]:
    """Parses ``host:port[,host:port...]`` (an ``http(s)://`` scheme is allowed).

    Args:
        text: the comma-separated endpoint list.

    Returns:
        The endpoints in the order given, stripped of blanks and trailing slashes.

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
        endpoints.append(item.rstrip("/"))
    return tuple(endpoints)


@dataclass(kw_only=True, slots=True, frozen=True)
class EtcdConfig:
    """How to reach etcd. Credentials never appear in the ``repr``."""

    endpoints: tuple[str, ...]
    """``host:port`` (or ``scheme://host:port``) client endpoints, tried in turn."""
    protocol: str = "http"
    """``http`` or ``https`` for endpoints given without a scheme."""
    request_timeout: timedelta = timedelta(seconds=5)
    """How long one HTTP request may take."""
    deadline: timedelta = timedelta(seconds=10)
    """How long a call may keep retrying transient failures before it gives up."""
    ca_cert: str | None = None
    """PEM CA bundle that signed the server certificates (TLS)."""
    cert: str | None = None
    """PEM client certificate (TLS client authentication)."""
    key: str | None = field(default=None, repr=False)
    """PEM private key of ``cert``."""
    username: str | None = None
    """etcd user (etcd's user/password authentication)."""
    password: str | None = field(default=None, repr=False)
    """Password of ``username``."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("no etcd endpoint given; pass --etcd host:port.")
        if self.protocol not in ("http", "https"):
            raise ConfigError(f"etcd protocol ({self.protocol!r}) must be http or https.")
        for name in ("request_timeout", "deadline"):
            value = getattr(self, name)
            if value <= timedelta(0):
                raise ConfigError(f"etcd {name} ({value}) must be positive.")
        if self.key and not self.cert:
            raise ConfigError("an etcd client key was given without a certificate; pass both.")
        if self.password and not self.username:
            raise ConfigError("an etcd password was given without a username; pass both.")


def config_from_env(
    endpoints: str | Sequence[str],
    *,
    protocol: str | None = None,
    ca_cert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    request_timeout: timedelta = timedelta(seconds=5),
    deadline: timedelta = timedelta(seconds=10),
) -> EtcdConfig:
    """Builds an :class:`EtcdConfig`, taking TLS files and credentials from the environment.

    Arguments given here win over ``ELASTIC_ETCD_{CA_CERT,CERT,KEY}``; the user and password
    come only from ``ELASTIC_ETCD_USERNAME``/``ELASTIC_ETCD_PASSWORD`` (never a command line,
    which every local user can read). Every client of elastic-run (the rendezvous, the start-up
    probe, ``elastic-run status``) builds its configuration here, so they agree.

    Args:
        endpoints: ``host:port[,host:port...]`` text, or the endpoints already split.
        protocol: ``http`` or ``https``; by default ``https`` when a CA or a client
            certificate is configured.
        ca_cert: CA bundle (default ``$ELASTIC_ETCD_CA_CERT``).
        cert: client certificate (default ``$ELASTIC_ETCD_CERT``).
        key: client key (default ``$ELASTIC_ETCD_KEY``).
        request_timeout: how long one HTTP request may take.
        deadline: how long a call may keep retrying.

    Raises:
        ConfigError: for an unparsable endpoint, a TLS file that does not exist, or a key or
            password without its certificate or user.
    """
    parsed = parse_endpoints(endpoints) if isinstance(endpoints, str) else tuple(endpoints)
    ca_cert = ca_cert or os.environ.get(env.ETCD_CA_CERT) or None
    cert = cert or os.environ.get(env.ETCD_CERT) or None
    key = key or os.environ.get(env.ETCD_KEY) or None
    for what, variable, path in (("CA bundle", env.ETCD_CA_CERT, ca_cert),
                                 ("client certificate", env.ETCD_CERT, cert),
                                 ("client key", env.ETCD_KEY, key)):
        if path and not os.path.isfile(path):
            raise ConfigError(
                f"the etcd {what} ({path}) is not a file; point {variable} at a PEM file."
            )
    return EtcdConfig(
        endpoints=parsed,
        protocol=protocol or ("https" if ca_cert or cert else "http"),
        request_timeout=request_timeout,
        deadline=deadline,
        ca_cert=ca_cert,
        cert=cert,
        key=key,
        username=os.environ.get(env.ETCD_USERNAME) or None,
        password=os.environ.get(env.ETCD_PASSWORD) or None,
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
        self._auth_lock = threading.Lock()
        self._session = self.new_session()
        self._http = self._new_pool()
        self._token: str | None = None

    def __repr__(self) -> str:
        return f"EtcdClient(endpoints={self.config.endpoints!r})"

    @property
    def endpoints_text(self) -> str:
        """The endpoints as the user gave them, for error messages."""
        return ",".join(self.config.endpoints)

    def new_session(self) -> requests.Session:
        """An HTTP session with this client's TLS settings (watch streams get their own)."""
        session = requests.Session()
        session.trust_env = False  # proxies must never see etcd traffic
        if self.config.ca_cert:
            session.verify = self.config.ca_cert
        if self.config.cert:
            session.cert = (self.config.cert, self.config.key) if self.config.key else \
                self.config.cert
        return session

    def _new_pool(self) -> urllib3.PoolManager:
        """The connection pool of this client's unary requests.

        Unary requests (one per membership change, one per lease refresh) go to urllib3
        directly: ``requests``' session machinery costs about a millisecond of CPU per
        request on a small machine, which a node agent pays every second for its lease and
        a simulation of a thousand agents pays a thousand times. Same TLS settings as
        :meth:`new_session` (requests' default CA bundle when none is given); no proxies.
        """
        tls: dict[str, Any] = {}
        if any(url.startswith("https://") for url in self._urls):
            tls = {"cert_reqs": "CERT_REQUIRED",
                   "ca_certs": self.config.ca_cert or requests.utils.DEFAULT_CA_BUNDLE_PATH,
                   "cert_file": self.config.cert, "key_file": self.config.key}
        return urllib3.PoolManager(num_pools=len(self._urls) + 1, maxsize=16, **tls)

    def endpoint_ports(self) -> frozenset[int]:
        """The TCP ports of this client's endpoints."""
        ports = {urllib.parse.urlsplit(url).port for url in self._urls}
        return frozenset(p for p in ports if p is not None)

    def current_url(self) -> str:
        """Base URL of the endpoint requests go to now."""
        with self._lock:
            return self._urls[self._current]

    def rotate(self, failed_url: str) -> None:
        """Moves on to the next endpoint after ``failed_url`` failed (no-op if already moved)."""
        with self._lock:
            if self._urls[self._current] == failed_url:
                self._current = (self._current + 1) % len(self._urls)

    def auth_headers(self) -> dict[str, str]:
        """The ``Authorization`` header when user/password authentication is on."""
        if self.config.username and self._token is None:
            self._authenticate(None)
        return {"Authorization": self._token} if self._token else {}

    def reauthenticate(self, stale_token: str | None) -> None:
        """Logs in again after etcd rejected ``stale_token`` (no-op without credentials)."""
        self._authenticate(stale_token)

    def _post(self, url: str, payload: dict[str, Any], headers: dict[str, str]) -> _Reply:
        """One POST; ``requests`` exceptions for every failure (the callers classify them)."""
        timeout = self.config.request_timeout.total_seconds()
        try:
            reply = self._http.request(
                "POST", url, body=json.dumps(payload).encode(),
                # "Accept" as requests sends it: without it, etcd's gateway (3.5) answers a
                # request that lacks credentials "permission denied", not "user name is empty".
                headers={"Content-Type": "application/json", "Accept": "*/*", **headers},
                timeout=urllib3.Timeout(connect=timeout, read=timeout), retries=False,
                redirect=False)
        except urllib3.exceptions.SSLError as exc:
            raise requests.exceptions.SSLError(str(exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise requests.exceptions.ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        return _Reply(reply.status, reply.data)

    def _post_once(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        url = self.current_url()
        try:
            headers = self.auth_headers()
            reply = self._post(url + path, payload, headers)
        except requests.RequestException as exc:
            self._raise_unless_tls_refusal(url, exc)
        if self.config.username and reply.status_code != 200 and (
            reply.status_code == 401 or _AUTH_REVISION_OLD in _grpc_message(reply)
        ):
            # An expired or revoked token, or one issued before the last change to etcd's
            # users and roles (JWT tokens carry that revision): log in again, then retry.
            self._authenticate(headers.get("Authorization"))
            raise Transient("auth token refreshed")
        if reply.status_code >= 500 or reply.status_code in (408, 429):
            self.rotate(url)
            raise Transient(f"{url}: HTTP {reply.status_code} {reply.text[:200].strip()}")
        if reply.status_code != 200:
            if _LEASE_GONE in _grpc_message(reply):
                raise LeaseGoneError(f"etcd ({url}) no longer holds lease "
                                     f"{int(payload.get('lease') or payload.get('ID') or 0):x} "
                                     "(it expired or was revoked)")
            raise EtcdAccessError(_rejection(url, reply, payload.get("key")))
        data: dict[str, Any] = reply.json()
        return data

    def _authenticate(self, stale_token: str | None) -> None:
        username = self.config.username
        if not username:
            return
        with self._auth_lock:
            if self._token is not None and self._token != stale_token:
                return  # another thread already logged in again
            url = self.current_url()
            try:
                reply = self._post(url + "/v3/auth/authenticate",
                                   {"name": username, "password": self.config.password or ""},
                                   {})
            except requests.RequestException as exc:
                self._raise_unless_tls_refusal(url, exc)
            if reply.status_code >= 500:
                self.rotate(url)
                raise Transient(f"{url}: HTTP {reply.status_code}")
            if reply.status_code != 200:
                message = _grpc_message(reply)
                if _GATEWAY_CN in message:
                    raise EtcdAccessError(_rejection(url, reply))
                # The reply names neither the password nor the token: safe to quote.
                raise EtcdAccessError(
                    f"etcd ({url}) refused the credentials of user {username!r} ({message}); "
                    f"check {env.ETCD_USERNAME} and {env.ETCD_PASSWORD}."
                )
            self._token = str(reply.json()["token"])

    def _raise_unless_tls_refusal(self, url: str, exc: requests.RequestException) -> NoReturn:
        """Raises EtcdAccessError for a TLS set-up no retry can fix; else a transient error."""
        refusal = _tls_refusal(url, exc, self.config)
        if refusal is not None:
            raise EtcdAccessError(refusal) from exc
        self.rotate(url)
        raise Transient(f"{url}: {type(exc).__name__}") from exc

    def call(
        self, path: str, payload: dict[str, Any], *, deadline: timedelta | None = None
    ) -> dict[str, Any]:
        """POSTs ``payload`` to the gateway ``path``, retrying transient failures.

        Args:
            path: gateway path, e.g. ``/v3/kv/range``.
            payload: the JSON request.
            deadline: how long to keep retrying; the configured deadline when ``None``.

        Returns:
            The decoded JSON reply.

        Raises:
            EtcdUnavailableError: when no endpoint answered within the deadline, or etcd
                rejected the request (credentials, permissions, a malformed request).
        """
        limit = (deadline or self.config.deadline).total_seconds()
        try:
            for attempt in RETRY_POLICY.copy(stop=stop_after_delay(limit)):
                with attempt:
                    return self._post_once(path, payload)
        except Transient as exc:
            raise EtcdUnavailableError(
                f"etcd ({self.endpoints_text}) did not answer within {limit:g} s (last error: "
                f"{exc}); check that etcd is running and reachable."
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def status(self, *, deadline: timedelta | None = None) -> dict[str, Any]:
        """etcd's maintenance status of the endpoint that answers (``deadline``: see
        :meth:`call`): the cheapest call that proves etcd answers and accepts this client."""
        return self.call("/v3/maintenance/status", {}, deadline=deadline)

    def get(self, key: str, *, deadline: timedelta | None = None) -> KeyValue | None:
        """Returns the key, or ``None`` if it does not exist (``deadline``: see :meth:`call`)."""
        kvs = self.call("/v3/kv/range", {"key": b64(key)}, deadline=deadline).get("kvs", [])
        return decode_kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Returns every key under ``prefix``, sorted by key."""
        return self.snapshot(prefix)[0]

    def snapshot(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Returns every key under ``prefix`` (sorted) and the revision they were read at."""
        reply = self.call(
            "/v3/kv/range", {"key": b64(prefix), "range_end": prefix_range_end(prefix)}
        )
        kvs = sorted((decode_kv(i) for i in reply.get("kvs", [])), key=lambda kv: kv.key)
        return kvs, int(reply["header"]["revision"])

    def get_many(self, keys: Sequence[str]) -> list[KeyValue | None]:
        """Reads several keys, up to :data:`MAX_TXN_OPS` per round trip; ``None`` if missing."""
        return self.get_many_at(keys)[0]

    def get_many_at(self, keys: Sequence[str]) -> tuple[list[KeyValue | None], int]:
        """Like :meth:`get_many`, plus a revision no later than any of the reads."""
        found: dict[str, KeyValue] = {}
        revision = 0
        for start in range(0, len(keys), MAX_TXN_OPS):
            reply = self.call("/v3/kv/txn", {
                "success": [{"request_range": {"key": b64(k)}}
                            for k in keys[start:start + MAX_TXN_OPS]],
            })
            revision = revision or int(reply["header"]["revision"])
            for response in reply.get("responses", []):
                for raw in response.get("response_range", {}).get("kvs", []):
                    kv = decode_kv(raw)
                    found[kv.key] = kv
        return [found.get(k) for k in keys], revision

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Writes several keys, up to :data:`MAX_TXN_OPS` atomically per round trip.

        Returns:
            The revision after the last write.
        """
        revision = 0
        for start in range(0, len(items), MAX_TXN_OPS):
            reply = self.call("/v3/kv/txn", {
                "success": [{"request_put": {"key": b64(k), "value": b64(v)}}
                            for k, v in items[start:start + MAX_TXN_OPS]],
            })
            revision = int(reply["header"]["revision"])
        return revision

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Writes ``key`` (attached to ``lease`` if non-zero); returns the new revision."""
        payload: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            payload["lease"] = str(lease)
        return int(self.call("/v3/kv/put", payload)["header"]["revision"])

    def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        """Writes ``key`` only if it does not exist; returns whether it was written."""
        return self.cas(key, value, None, lease=lease)[0]

    def cas(
        self, key: str, value: bytes, expected_mod_revision: int | None, *, lease: int = 0,
        delete_range: tuple[str, str] | None = None, fence: tuple[str, int] | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Writes ``key`` only if its mod revision is ``expected_mod_revision``.

        ``None`` means "only if the key does not exist". One transaction: when the compare
        fails, its failure branch reads the current value, so a lost race costs no extra
        round trip. A retried duplicate (the reply to the first attempt was lost) fails its
        compare and returns the value the first attempt wrote, which the caller must treat as
        authoritative.

        Args:
            key: The key.
            value: Its new value.
            expected_mod_revision: The compare (``None``: the key must not exist).
            lease: Attach the key to this lease (0: none).
            delete_range: ``(start, end)``: when the compare holds, every key ``k`` with
                ``start <= k < end`` is deleted in the same transaction (``key`` must not be
                among them: etcd refuses a transaction that writes and deletes one key).
            fence: ``(fence_key, create_revision)``: write only if ``fence_key`` also still
                exists with this create revision, in the same transaction (a leader's term:
                its leader key, which goes with its lease, is created anew by each election).

        Returns:
            ``(written, current)``: ``current`` is the key after the transaction.
        """
        compare: dict[str, Any] = {"key": b64(key), "result": "EQUAL"}
        if expected_mod_revision is None:
            compare.update(target="CREATE", create_revision="0")
        else:
            compare.update(target="MOD", mod_revision=str(expected_mod_revision))
        compares = [compare]
        if fence is not None:
            compares.append({"key": b64(fence[0]), "result": "EQUAL", "target": "CREATE",
                             "create_revision": str(fence[1])})
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        success: list[dict[str, Any]] = [{"request_put": put}]
        if delete_range is not None:
            start, end = delete_range
            success.append({"request_delete_range": {"key": b64(start),
                                                     "range_end": b64(end)}})
        reply = self.call("/v3/kv/txn", {
            "compare": compares,
            "success": [*success, {"request_range": {"key": b64(key)}}],
            "failure": [{"request_range": {"key": b64(key)}}],
        })
        written = bool(reply.get("succeeded", False))
        responses = reply.get("responses", [])
        kvs = responses[-1].get("response_range", {}).get("kvs", []) if responses else []
        return written, (decode_kv(kvs[0]) if kvs else None)

    def delete(self, key: str) -> int:
        """Deletes ``key``; returns how many keys were deleted."""
        return int(self.call("/v3/kv/deleterange", {"key": b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every key under ``prefix``; returns how many keys were deleted."""
        reply = self.call(
            "/v3/kv/deleterange", {"key": b64(prefix), "range_end": prefix_range_end(prefix)}
        )
        return int(reply.get("deleted", 0))

    def attach_prefix_to_lease(self, prefix: str, lease: int) -> int:
        """Puts every key under ``prefix`` on ``lease``, values untouched; returns how many.

        Each batch of up to :data:`MAX_TXN_OPS` keys is one transaction of ``ignore_value``
        puts guarded by "the key still exists" (a put of a deleted key would fail the whole
        transaction). A batch that meets a key deleted meanwhile is read again, so a key that
        goes is skipped and one that stays is never rewritten with an old value. A key written
        after the prefix was read stays off the lease.
        """
        attached = 0
        keys = [kv.key for kv in self.get_prefix(prefix)]
        for start in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[start:start + MAX_TXN_OPS]
            for _ in range(3):
                reply = self.call("/v3/kv/txn", {
                    "compare": [{"key": b64(k), "result": "GREATER", "target": "VERSION",
                                 "version": "0"} for k in batch],
                    "success": [{"request_put": {"key": b64(k), "ignore_value": True,
                                                 "lease": str(lease)}} for k in batch],
                })
                if reply.get("succeeded", False):
                    attached += len(batch)
                    break
                batch = [kv.key for kv in self.get_many(batch) if kv is not None]
                if not batch:
                    break
        return attached

    def grant_lease(self, ttl: int) -> int:
        """Grants a lease of ``ttl`` seconds; returns its id."""
        return int(self.call("/v3/lease/grant", {"TTL": str(ttl)})["ID"])

    def keep_alive_once(self, lease_id: int, *, deadline: timedelta | None = None) -> int:
        """Refreshes a lease; returns its remaining TTL (0 or less once it has expired)."""
        reply = self.call("/v3/lease/keepalive", {"ID": str(lease_id)}, deadline=deadline)
        if "error" in reply:
            return 0
        return int(reply.get("result", {}).get("TTL", 0))

    def lease_time_to_live(self, lease_id: int, *,
                           deadline: timedelta | None = None) -> tuple[int, int]:
        """A lease's remaining and granted TTL in whole seconds (``deadline``: see :meth:`call`).

        etcd truncates the remaining time to whole seconds; it is -1 once the lease is gone.
        """
        reply = self.call("/v3/lease/timetolive", {"ID": str(lease_id)}, deadline=deadline)
        # The gateway leaves zero-valued fields out: a lease with under a second left has no TTL.
        return int(reply.get("TTL", 0)), int(reply.get("grantedTTL", 0))

    def revoke_lease(self, lease_id: int, *, deadline: timedelta | None = None) -> None:
        """Revokes a lease, deleting every key attached to it (``deadline``: see :meth:`call`)."""
        with contextlib.suppress(LeaseGoneError):  # gone already
            self.call("/v3/lease/revoke", {"ID": str(lease_id)}, deadline=deadline)

    def lease(self, ttl: int, *, on_lost: Callable[[Lease], None] | None = None) -> Lease:
        """Grants a lease of ``ttl`` seconds kept alive by a daemon thread (see :class:`Lease`)."""
        return Lease(self, ttl, on_lost=on_lost)

    def watch_prefix(
        self, prefix: str, *, on_change: Callable[[Sequence[WatchEvent]], None] | None = None,
        idle_reconnect: timedelta = WATCH_IDLE_RECONNECT,
    ) -> PrefixWatch:
        """Mirrors every key under ``prefix`` in memory (see :class:`PrefixWatch`)."""
        return PrefixWatch(self, prefix, on_change=on_change, idle_reconnect=idle_reconnect)

    def wait_for_keys(self, keys: Sequence[str], timeout: timedelta) -> list[KeyValue]:
        """Blocks until every key exists, woken by a watch (see :func:`wait_for_keys`)."""
        return wait_for_keys(self, keys, timeout)

    def close(self) -> None:
        """Closes the HTTP connections (watches and leases have their own threads to stop)."""
        self._session.close()
        self._http.clear()


@dataclass(frozen=True, slots=True)
class _Reply:
    """A gateway reply: what the error handling reads of it."""

    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


def _grpc_message(reply: _Reply) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:200].strip()
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)[:200]
    return str(body)[:200]


_AUTH_REVISION_OLD: Final = "revision of auth store is old"
_LEASE_GONE: Final = "requested lease not found"
_GATEWAY_CN: Final = "CommonName of client sending a request against gateway"
_SSL_REASON: Final = re.compile(r"\[SSL: ([A-Z0-9_]+)\] ([^(']+?)\s*\(_ssl")
# Alerts etcd sends when it rejects the client's certificate (none, or from an unknown CA).
_CLIENT_CERT_ALERTS: Final = ("ALERT_BAD_CERTIFICATE", "ALERT_CERTIFICATE_REQUIRED",
                              "ALERT_UNKNOWN_CA", "ALERT_CERTIFICATE_UNKNOWN")


def _tls_refusal(url: str, exc: requests.RequestException, config: EtcdConfig) -> str | None:
    """The one-sentence error for a TLS failure that retrying cannot fix, else ``None``."""
    if not isinstance(exc, requests.exceptions.SSLError):
        return None
    match = _SSL_REASON.search(str(exc))
    if match is None:
        return None  # e.g. an EOF mid-handshake while etcd restarts: worth retrying
    code, reason = match.groups()
    if code == "CERTIFICATE_VERIFY_FAILED":
        trusted = config.ca_cert or "the system CA store"
        return (
            f"etcd ({url}) presented a server certificate that {trusted} does not trust "
            f"({reason}); point {env.ETCD_CA_CERT} at the CA that signed etcd's certificate."
        )
    if any(alert in code for alert in _CLIENT_CERT_ALERTS):
        given = config.cert or "none was given"
        return (
            f"etcd ({url}) refused this client's TLS certificate ({given}: {reason}); set "
            f"{env.ETCD_CERT} and {env.ETCD_KEY} to a certificate signed by a CA etcd trusts."
        )
    if code == "WRONG_VERSION_NUMBER":
        return (
            f"etcd ({url}) does not speak TLS ({reason}); use an http endpoint, or unset "
            f"{env.ETCD_CA_CERT} and {env.ETCD_CERT}."
        )
    return None


def _rejection(url: str, reply: _Reply, key: Any = None) -> str:
    message = _grpc_message(reply)
    if "user name is empty" in message or "invalid auth token" in message:
        hint = (f"etcd requires authentication; set {env.ETCD_USERNAME} and "
                f"{env.ETCD_PASSWORD}.")
    elif "permission denied" in message:
        where = ""
        if isinstance(key, str):
            with contextlib.suppress(ValueError):
                where = f" (here {base64.b64decode(key).decode()})"
        hint = f"grant the etcd user read/write access to the job's key prefix{where}."
    elif _GATEWAY_CN in message:
        # etcd's JSON gateway cannot pass a certificate's CN on as the user, so with auth on
        # it refuses any client certificate that has one.
        hint = (f"with auth enabled etcd's gateway refuses client certificates that have a "
                f"CommonName; issue the one in {env.ETCD_CERT} without a CN (e.g. "
                "-subj /O=elastic-run) and log in with user and password.")
    else:
        hint = "check the etcd version (3.4 or later) and the request."
    return f"etcd ({url}) rejected the request with HTTP {reply.status_code} ({message}); {hint}"


class LeaseGoneError(EtcdUnavailableError):
    """etcd no longer holds the lease a request named: it expired (etcd stalled, or this
    process could not refresh it for its TTL) or someone revoked it. A node takes a new lease
    and joins again (:class:`~membership.node.NodeMembership`)."""


class Lease:
    """A lease kept alive by a daemon thread until :meth:`revoke` (or its owner's death).

    The thread refreshes the lease every ``ttl / 3`` seconds (:func:`keep_alive_period`). If
    etcd reports the lease gone (it expired while this process could not reach etcd, or
    someone revoked it), :attr:`lost` is set and ``on_lost`` is called once, from the
    keep-alive thread.

    Args:
        client: the client to use.
        ttl: seconds etcd keeps the lease without a refresh (etcd's minimum is about 2).
        on_lost: called once when the lease is known to be gone; must not block.
    """

    def __init__(
        self, client: EtcdClient, ttl: int, *, on_lost: Callable[[Lease], None] | None = None
    ) -> None:
        if ttl < 1:
            raise ConfigError(f"etcd lease ttl ({ttl}) must be at least 1 second.")
        self._client = client
        self.ttl = ttl
        self.id = client.grant_lease(ttl)
        self.lost = threading.Event()
        #: ``time.monotonic()`` of the last refresh etcd confirmed (the grant counts as one):
        #: etcd drops the lease ``ttl`` seconds after it, so a holder that cannot refresh
        #: knows how long it may still act as a member.
        self.last_refreshed = time.monotonic()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"etcd-lease-{self.id:x}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"Lease(id={self.id:#x}, ttl={self.ttl}, lost={self.lost.is_set()})"

    def _run(self) -> None:
        interval = keep_alive_period(self.ttl)
        # One refresh may take at most one interval, so a slow etcd never delays the next.
        deadline = timedelta(seconds=interval)
        while not self._stop.wait(interval):
            try:
                remaining = self._client.keep_alive_once(self.id, deadline=deadline)
            except Exception:  # etcd unreachable: keep trying; it tells us when it is gone
                logger.warning("keeping etcd lease %x alive failed; retrying", self.id,
                               exc_info=logger.isEnabledFor(logging.DEBUG))
                continue
            if remaining > 0:
                self.last_refreshed = time.monotonic()
            if remaining <= 0 and not self._stop.is_set():
                logger.warning("etcd lease %x is gone (expired or revoked)", self.id)
                self.lost.set()
                if self._on_lost is not None:
                    try:
                        self._on_lost(self)
                    except Exception:
                        logger.exception("etcd lease-loss callback failed")
                return

    def fresh(self, margin: float = 0.5) -> bool:
        """Whether etcd certainly still holds the lease: refreshed less than ``margin * ttl``
        seconds ago and not known lost (a partitioned holder turns not fresh well before
        etcd expires the lease, so it stops acting as a member in time)."""
        return not self.lost.is_set() and (
            time.monotonic() - self.last_refreshed < margin * self.ttl)

    def stop(self) -> None:
        """Stops refreshing without revoking (the lease then expires after its TTL)."""
        self._stop.set()

    def revoke(self) -> None:
        """Stops the keep-alive thread and revokes the lease (best effort)."""
        self._stop.set()
        try:
            self._client.revoke_lease(self.id)
        except Exception:  # the lease expires on its own within its TTL anyway
            logger.debug("revoking etcd lease %x failed", self.id, exc_info=True)


__all__ = [
    "RETRY_POLICY",
    "WATCH_IDLE_RECONNECT",
    "EtcdClient",
    "EtcdConfig",
    "KeyValue",
    "Lease",
    "LeaseGoneError",
    "PrefixWatch",
    "WatchEvent",
    "config_from_env",
    "keep_alive_period",
    "parse_endpoints",
    "wait_for_keys",
]
