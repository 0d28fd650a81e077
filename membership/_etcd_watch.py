"""Watches over etcd's JSON gateway (private to :mod:`membership.etcd`, which re-exports them).

:class:`PrefixWatch` mirrors every key under a prefix in memory: it reads a snapshot, then
follows a watch stream from the snapshot's revision on a daemon thread. When the stream breaks
(etcd restarted, an endpoint died, the stream sat idle) it reconnects to the next endpoint and
resumes from the last revision it saw, so no event is lost; if that revision has been compacted
away it reads a fresh snapshot and reports the difference as events. Reconnecting gives up only
after the client's deadline of continuous failure, and then says so (:attr:`PrefixWatch.failed`);
:meth:`PrefixWatch.resume` follows again once etcd answers.

:func:`wait_for_keys` blocks until keys exist, woken by a watch rather than by polling.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Literal, Protocol

import requests
from tenacity import retry_if_exception_type, stop_after_delay

from elastic_errors import EtcdUnavailableError
from membership._etcd_wire import RETRY_POLICY, KeyValue, b64, decode_kv, prefix_range_end


class EtcdClient(Protocol):
    """What a watch needs from :class:`membership.etcd.EtcdClient` (no import of it: the
    client imports this module)."""

    @property
    def config(self) -> Any: ...
    @property
    def endpoints_text(self) -> str: ...
    def current_url(self) -> str: ...
    def rotate(self, failed_url: str) -> None: ...
    def auth_headers(self) -> dict[str, str]: ...
    def reauthenticate(self, stale_token: str | None) -> None: ...
    def new_session(self) -> requests.Session: ...
    def snapshot(self, prefix: str) -> tuple[list[KeyValue], int]: ...
    def get_many_at(self, keys: Sequence[str]) -> tuple[list[KeyValue | None], int]: ...

logger = logging.getLogger(__name__)

_IDLE_RECONNECT: Final = timedelta(seconds=10)
# How etcd words a watch it canceled for its client's (expired) auth token.
_AUTH_CANCEL: Final = re.compile(r"PermissionDenied|Unauthenticated|invalid auth token")
_READ_CHUNK: Final = 1 << 16


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix."""

    type: Literal["PUT", "DELETE"]
    key: str
    kv: KeyValue | None
    """The key after a ``PUT``; ``None`` for a ``DELETE``."""
    revision: int


class _StreamFailed(Exception):
    """The watch stream could not be opened (worth retrying elsewhere or later)."""


class _Compacted(Exception):
    """The revision to resume from has been compacted away."""


def _shutdown(response: requests.Response | None) -> None:
    # Closing a response from another thread does not wake a blocked read; shutting the
    # socket down does, so cancel() takes effect at once instead of at the idle timeout.
    if response is None:
        return
    conn = getattr(response.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        response.close()


class _Stream:
    """One watch stream on one endpoint."""

    def __init__(
        self, client: EtcdClient, session: requests.Session, request: dict[str, Any],
        read_timeout: float,
    ) -> None:
        self._client = client
        url = client.current_url()
        try:
            self.response = session.post(
                url + "/v3/watch", json={"create_request": request}, stream=True,
                headers=client.auth_headers(),
                timeout=(client.config.request_timeout.total_seconds(), read_timeout),
            )
        except requests.RequestException as exc:
            client.rotate(url)
            raise _StreamFailed(f"{url}: {type(exc).__name__}") from exc
        if self.response.status_code == 401 and client.config.username:
            client.reauthenticate(self.response.request.headers.get("Authorization"))
            raise _StreamFailed("auth token refreshed")
        if self.response.status_code != 200:
            client.rotate(url)
            raise _StreamFailed(f"{url}: HTTP {self.response.status_code}")
        # Reads return what the current HTTP chunk holds (a small event is not held back);
        # requests' default of 512 bytes would re-join a large event (a world record of a
        # thousand nodes is ~100 KB) hundreds of times, quadratic in its size.
        self._lines = self.response.iter_lines(chunk_size=_READ_CHUNK)
        first = self.next_result()  # the "created" reply proves the stream is live
        if first is None or not first.get("created"):
            raise _StreamFailed(f"{url}: the watch was not created ({first})")

    def next_result(self) -> dict[str, Any] | None:
        """The next ``result`` message; ``None`` when the stream ended or sat idle too long."""
        try:
            line = next(self._lines, None)
        except (requests.RequestException, OSError, ValueError, AttributeError):
            # AttributeError: cancel() closed the response while this thread was inside
            # urllib3's chunked read, which then finds its file object gone (``fp`` is None).
            return None
        if not line:
            return None
        message = json.loads(line)
        if "error" in message:
            raise _StreamFailed(str(message["error"])[:200])
        result: dict[str, Any] = message.get("result", {})
        if result.get("canceled"):
            if int(result.get("compact_revision", 0) or 0) > 0:
                raise _Compacted(str(result["compact_revision"]))
            reason = str(result.get("cancel_reason", ""))
            if self._client.config.username and _AUTH_CANCEL.search(reason):
                # etcd cancels a live watch whose token expired (its auth token TTL) with
                # PermissionDenied: the next stream must log in again, or it fails the same.
                # Best effort: a login that fails now is retried, and reported, with the
                # next stream.
                try:
                    self._client.reauthenticate(
                        self.response.request.headers.get("Authorization"))
                except Exception as exc:
                    logger.debug("logging in again after a canceled watch failed: %s", exc)
            raise _StreamFailed(f"the watch was canceled ({reason})")
        return result


def _events(result: dict[str, Any]) -> Iterator[WatchEvent]:
    for raw in result.get("events", []):
        kv = decode_kv(raw["kv"])
        if raw.get("type") == "DELETE":
            yield WatchEvent("DELETE", kv.key, None, kv.mod_revision)
        else:
            yield WatchEvent("PUT", kv.key, kv, kv.mod_revision)


class PrefixWatch:
    """A supervised watch that mirrors every key under ``prefix`` in memory.

    The constructor reads the first snapshot (so :meth:`items` is complete at once) and starts
    a daemon thread that follows changes.

    Args:
        client: the etcd client (its endpoints, TLS, credentials and deadline are used).
        prefix: the key prefix to mirror.
        on_change: called from the watch thread with each batch of events, after the mirror
            has been updated; it must be quick and must not block.
        idle_reconnect: an idle stream is re-opened after this long, which also bounds how
            long a hung (SIGSTOPped) etcd goes unnoticed.

    Raises:
        EtcdUnavailableError: if the first snapshot cannot be read within the deadline.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        *,
        on_change: Callable[[Sequence[WatchEvent]], None] | None = None,
        idle_reconnect: timedelta = _IDLE_RECONNECT,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._on_change = on_change
        self._idle = idle_reconnect.total_seconds()
        self._cond = threading.Condition()
        self._mirror: dict[str, KeyValue] = {}
        self._revision = 0
        self._stop = threading.Event()
        self._response: requests.Response | None = None
        self.failed = threading.Event()
        """Set when reconnecting failed for longer than the client's deadline."""
        self.error: EtcdUnavailableError | None = None
        self.reconnects = 0
        # The first stream is opened before the snapshot is read, watching from "now": etcd
        # then adds it to its synced watchers at once. Opened after the snapshot, from the
        # snapshot's revision, it would start behind whenever anything was written meanwhile,
        # and etcd would have to replay the history since that revision for it; with a
        # thousand nodes joining together, that replay is what etcd spends its time on.
        self._session = client.new_session()
        self._initial: _Stream | None = None
        try:
            self._initial = _Stream(client, self._session, {
                "key": b64(prefix), "range_end": prefix_range_end(prefix)}, self._idle)
            self._response = self._initial.response
        except _StreamFailed:
            pass  # the thread opens one from the snapshot's revision, as after a break
        try:
            self._resync()
        except BaseException:
            self._drop_initial()
            self._session.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch:{prefix}",
                                        daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"PrefixWatch(prefix={self._prefix!r}, revision={self._revision})"

    @property
    def revision(self) -> int:
        """The etcd revision the mirror reflects."""
        with self._cond:
            return self._revision

    def items(self) -> dict[str, KeyValue]:
        """A copy of the mirrored keys."""
        with self._cond:
            return dict(self._mirror)

    def wait_for(
        self, predicate: Callable[[Mapping[str, KeyValue]], bool], timeout: timedelta
    ) -> bool:
        """Waits until ``predicate(mirror)`` holds; returns whether it did within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(
                lambda: predicate(self._mirror) or self.failed.is_set(),
                timeout.total_seconds(),
            ) and predicate(self._mirror)

    def resume(self) -> None:
        """Follows again after :attr:`failed` was set (etcd answers again).

        Reads a fresh snapshot (reported to ``on_change`` as the difference from the mirror,
        like a resync after compaction), clears :attr:`failed` and starts a new thread. A
        no-op while the watch has not failed.

        Raises:
            EtcdUnavailableError: If the snapshot cannot be read within the client's deadline
                (the watch stays failed).
            RuntimeError: If the watch was cancelled.
        """
        if self._stop.is_set():
            raise RuntimeError(f"{self!r} was cancelled; it cannot resume.")
        if not self.failed.is_set():
            return
        self._thread.join(timeout=5.0)  # it returns right after setting ``failed``
        self._resync()
        with self._cond:
            self.failed.clear()
            self.error = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch:{self._prefix}",
                                        daemon=True)
        self._thread.start()
        logger.info("watch of %s resumed at revision %d", self._prefix, self.revision)

    def cancel(self) -> None:
        """Stops the watch thread (at once; it is a daemon either way)."""
        self._stop.set()
        _shutdown(self._response)

    def _apply(self, events: Sequence[WatchEvent]) -> None:
        if not events:
            return
        with self._cond:
            for event in events:
                if event.kv is not None:
                    self._mirror[event.key] = event.kv
                else:
                    self._mirror.pop(event.key, None)
                self._revision = max(self._revision, event.revision)
            self._cond.notify_all()
        if self._on_change is not None:
            try:
                self._on_change(events)
            except Exception:
                logger.exception("watch callback for %s failed", self._prefix)

    def _resync(self) -> None:
        kvs, revision = self._client.snapshot(self._prefix)
        fresh = {kv.key: kv for kv in kvs}
        with self._cond:
            old = dict(self._mirror)
        events = [WatchEvent("DELETE", k, None, revision) for k in old if k not in fresh]
        events += [WatchEvent("PUT", k, kv, revision) for k, kv in fresh.items()
                   if old.get(k) != kv]
        self._apply(events)
        with self._cond:
            self._mirror = fresh
            self._revision = revision
            self._cond.notify_all()

    def _drop_initial(self) -> None:
        initial, self._initial = self._initial, None
        if initial is not None:
            _shutdown(initial.response)

    def _follow(self, session: requests.Session) -> None:
        stream, self._initial = self._initial, None
        if stream is None:
            request = {
                "key": b64(self._prefix),
                "range_end": prefix_range_end(self._prefix),
                "start_revision": str(self.revision + 1),
            }
            stream = _Stream(self._client, session, request, self._idle)
        self._response = stream.response
        try:
            if self._stop.is_set():
                return
            while (result := stream.next_result()) is not None:
                # The first stream may repeat what the snapshot already holds.
                known = self.revision
                self._apply([e for e in _events(result) if e.revision > known])
        finally:
            self._response = None
            _shutdown(stream.response)

    def _run(self) -> None:
        deadline = self._client.config.deadline.total_seconds()
        session = self._session
        try:
            while not self._stop.is_set():
                # A fresh policy per stream: the deadline counts only continuous failure.
                policy = RETRY_POLICY.copy(
                    stop=stop_after_delay(deadline),
                    retry=retry_if_exception_type((_StreamFailed, _Compacted,
                                                   EtcdUnavailableError)),
                )
                try:
                    for attempt in policy:
                        with attempt:
                            if self._stop.is_set():
                                return
                            try:
                                self._follow(session)
                            except _Compacted:
                                logger.info("watch of %s fell behind compaction; resyncing",
                                            self._prefix)
                                self._resync()
                                raise
                except (_StreamFailed, _Compacted, EtcdUnavailableError) as exc:
                    if self._stop.is_set():
                        return
                    self.error = EtcdUnavailableError(
                        f"etcd ({self._client.endpoints_text}) could not be watched for "
                        f"{deadline:g} s (last error: {exc}); check that etcd is running."
                    )
                    logger.error("%s", self.error)
                    with self._cond:
                        self.failed.set()
                        self._cond.notify_all()
                    return
                self.reconnects += 1
        finally:
            session.close()


def wait_for_keys(
    client: EtcdClient, keys: Sequence[str], timeout: timedelta
) -> list[KeyValue]:
    """Blocks until every key in ``keys`` exists; woken by a watch, not by polling.

    Args:
        client: the etcd client.
        keys: full etcd keys.
        timeout: how long to wait in total.

    Returns:
        The keys' values, in the order of ``keys``.

    Raises:
        TimeoutError: naming the missing keys, when ``timeout`` passes first.
        EtcdUnavailableError: when etcd cannot be reached within the client's deadline.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    session: requests.Session | None = None
    try:
        while True:
            values, revision = client.get_many_at(keys)
            found = {kv.key: kv for kv in values if kv is not None}
            if all(k in found for k in keys):
                return [found[k] for k in keys]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k in keys if k not in found]
                raise TimeoutError(
                    f"timed out after {timeout.total_seconds():g} s waiting for etcd keys "
                    f"{missing}"
                )
            session = session or client.new_session()
            lo, hi = min(keys), max(keys)
            request = {
                "key": b64(lo),
                "range_end": b64(hi.encode() + b"\0"),
                "start_revision": str(revision + 1),
            }
            try:
                stream = _Stream(client, session, request, max(remaining, 0.05))
            except _StreamFailed:
                time.sleep(min(0.1, max(remaining, 0.0)))
                continue  # re-read (which fails with the deadline if etcd is gone)
            try:
                wanted = set(keys)
                while (result := stream.next_result()) is not None:
                    for event in _events(result):
                        if event.key not in wanted:
                            continue
                        if event.kv is not None:
                            found[event.key] = event.kv
                        else:
                            found.pop(event.key, None)
                    if all(k in found for k in keys):
                        return [found[k] for k in keys]
            except (_StreamFailed, _Compacted):
                pass
            finally:
                _shutdown(stream.response)
    finally:
        if session is not None:
            session.close()
