"""Preemption-notice watchers: hear that this node is about to be taken away, before it is.

Each watcher polls one source on a daemon thread and calls its callback exactly once with a
:class:`PreemptionNotice`; the owner then finishes or abandons the step, takes a final checkpoint if
the deadline allows, and leaves the rendezvous explicitly so the departure is planned, not a
failure. Sources:

* AWS: IMDSv2 ``/latest/meta-data/spot/instance-action`` (404 until scheduled; 2 min warning).
* GCP: ``/computeMetadata/v1/instance/preempted`` long poll (``TRUE`` on preemption; 30 s).
* Azure: Scheduled Events, a ``Preempt`` event (>= 30 s).
* SIGTERM (Kubernetes, any scheduler): the grace period before SIGKILL.

Every metadata base URL is configurable (flag or environment variable) so tests serve fakes on
127.0.0.1. All three clouds answer on the link-local 169.254.169.254, which the defaults use
instead of DNS names: a name lookup cannot be bounded by a socket timeout, an IP connect can, so a
node that is not in a cloud never hangs in :func:`detect_watchers`.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from types import FrameType
from typing import Any, ClassVar, Final

import requests

from elastic import env
from elastic_errors import ConfigError

logger = logging.getLogger(__name__)

LINK_LOCAL_METADATA: Final = "http://169.254.169.254"
KINDS: Final = ("aws", "gcp", "azure", "sigterm")
"""Sources accepted by ``--preemption-watch`` besides ``auto`` and ``none``."""

DEFAULT_POLL_INTERVAL: Final = timedelta(seconds=5)
DEFAULT_REQUEST_TIMEOUT: Final = timedelta(seconds=2)
DEFAULT_PROBE_TIMEOUT: Final = timedelta(seconds=1)
# GCP's long poll: the server holds the request this long; our socket timeout is a little longer.
DEFAULT_GCP_LONG_POLL: Final = timedelta(seconds=30)
AWS_TOKEN_TTL: Final = timedelta(hours=6)


@dataclass(kw_only=True, slots=True, frozen=True)
class PreemptionNotice:
    """This node will be taken away.

    Attributes:
        source: Which watcher heard it (``aws``, ``gcp``, ``azure``, ``sigterm``).
        deadline: When the machine goes away (UTC), or None if the source does not say.
        detail: The raw notice, for logs (never contains credentials).
    """

    source: str
    deadline: datetime | None
    detail: str

    def time_left(self, now: datetime | None = None) -> timedelta | None:
        """Time until the deadline (negative once past), or None without a deadline."""
        if self.deadline is None:
            return None
        return self.deadline - (now or datetime.now(timezone.utc))


NoticeCallback = Callable[[PreemptionNotice], None]


def _seconds(value: timedelta, name: str) -> float:
    seconds = value.total_seconds()
    if seconds <= 0:
        raise ConfigError(f"{name} ({value}) must be positive; pass a positive timedelta.")
    return seconds


def _session() -> requests.Session:
    session = requests.Session()
    # Metadata servers are link-local: an HTTP(S)_PROXY from the environment must not apply.
    session.trust_env = False
    return session


class PreemptionWatcher(abc.ABC):
    """Base class: poll :meth:`check` on a daemon thread until a notice or :meth:`stop`.

    Subclasses implement :meth:`check` (one poll; returns a notice or None, raises
    ``requests.RequestException``/``ValueError`` on transport or format errors, which are logged
    and polled again) and :meth:`probe` (is this source present on this machine?).
    """

    source: ClassVar[str] = ""

    def __init__(self, *, poll_interval: timedelta = DEFAULT_POLL_INTERVAL) -> None:
        self._poll_s = _seconds(poll_interval, "poll_interval")
        self._stop = threading.Event()
        self._fired = threading.Event()
        self._thread: threading.Thread | None = None
        self._callback: NoticeCallback | None = None
        self._lock = threading.Lock()

    @abc.abstractmethod
    def check(self) -> PreemptionNotice | None:
        """Poll the source once; a notice if this node is being preempted, else None."""

    def probe(self, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> bool:
        """Whether this source exists here (answers within ``timeout``); never raises."""
        return False

    @property
    def fired(self) -> bool:
        """Whether the callback has been called."""
        return self._fired.is_set()

    def start(self, callback: NoticeCallback) -> None:
        """Start polling on a daemon thread; ``callback`` is called at most once, on that thread."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"{type(self).__name__} was already started")
            self._callback = callback
            self._thread = threading.Thread(
                target=self._run, name=f"preemption-{self.source}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop polling and wait up to ``timeout`` for the thread (it is a daemon either way)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout.total_seconds())

    def __enter__(self) -> PreemptionWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _deliver(self, notice: PreemptionNotice) -> None:
        with self._lock:
            if self._fired.is_set() or self._callback is None:
                return
            self._fired.set()
            callback = self._callback
        logger.warning(
            "Preemption notice from %s: deadline %s (%s)", notice.source, notice.deadline,
            notice.detail,
        )
        try:
            callback(notice)
        except Exception:  # the watcher thread must not die silently with the callback's bug
            logger.exception("Preemption callback failed for a notice from %s", notice.source)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                notice = self.check()
                failures = 0
            except (requests.RequestException, ValueError) as exc:
                failures += 1
                # Log the first failure and then every 60th: a flaky metadata server must not
                # flood the log, and one that never answers must still be visible.
                log = logger.warning if failures % 60 == 1 else logger.debug
                log("Preemption watcher %s could not poll (%s); retrying", self.source, exc)
                notice = None
            if notice is not None and not self._stop.is_set():
                self._deliver(notice)
                return
            self._stop.wait(self._poll_s)


class AwsSpotWatcher(PreemptionWatcher):
    """AWS spot interruption notice via IMDSv2 (token PUT, then GET ``spot/instance-action``)."""

    source = "aws"
    TOKEN_PATH: Final = "/latest/api/token"
    ACTION_PATH: Final = "/latest/meta-data/spot/instance-action"

    def __init__(
        self,
        *,
        base_url: str | None = None,
        poll_interval: timedelta = DEFAULT_POLL_INTERVAL,
        request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT,
        token_ttl: timedelta = AWS_TOKEN_TTL,
    ) -> None:
        super().__init__(poll_interval=poll_interval)
        self.base_url = (base_url or os.environ.get(env.AWS_METADATA_URL) or LINK_LOCAL_METADATA)
        self.base_url = self.base_url.rstrip("/")
        self._timeout_s = _seconds(request_timeout, "request_timeout")
        self._ttl_s = int(_seconds(token_ttl, "token_ttl"))
        self._session = _session()
        self._token: str | None = None
        self._token_expiry = 0.0

    def _fetch_token(self, timeout_s: float) -> str:
        response = self._session.put(
            self.base_url + self.TOKEN_PATH,
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self._ttl_s)},
            timeout=timeout_s,
        )
        response.raise_for_status()
        token = response.text.strip()
        if not token:
            raise ValueError("IMDS returned an empty session token")
        # Renew at 90 % of the TTL so a token never expires between fetch and use.
        self._token, self._token_expiry = token, time.monotonic() + 0.9 * self._ttl_s
        return token

    def _get_action(self) -> requests.Response:
        token = self._token
        if token is None or time.monotonic() >= self._token_expiry:
            token = self._fetch_token(self._timeout_s)
        return self._session.get(
            self.base_url + self.ACTION_PATH,
            headers={"X-aws-ec2-metadata-token": token},
            timeout=self._timeout_s,
        )

    def check(self) -> PreemptionNotice | None:
        response = self._get_action()
        if response.status_code == 401:  # token expired or IMDS restarted: renew once
            self._token = None
            response = self._get_action()
        if response.status_code == 404:
            return None
        response.raise_for_status()
        body = response.json()
        if not isinstance(body, dict) or "action" not in body:
            raise ValueError(f"unexpected spot/instance-action body {response.text[:200]!r}")
        deadline = _parse_iso(str(body.get("time", "")))
        return PreemptionNotice(source=self.source, deadline=deadline, detail=response.text.strip())

    def probe(self, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> bool:
        try:
            self._fetch_token(timeout.total_seconds())
        except (requests.RequestException, ValueError):
            return False
        return True


class GcpPreemptionWatcher(PreemptionWatcher):
    """GCP ``instance/preempted`` (``TRUE`` once preempted), read with a bounded long poll."""

    source = "gcp"
    PATH: Final = "/computeMetadata/v1/instance/preempted"
    HEADERS: Final = {"Metadata-Flavor": "Google"}
    # GCE sends a shutdown after ~30 s; the notice itself carries no time.
    WARNING: Final = timedelta(seconds=30)

    def __init__(
        self,
        *,
        base_url: str | None = None,
        poll_interval: timedelta = timedelta(seconds=1),
        request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT,
        long_poll: timedelta = DEFAULT_GCP_LONG_POLL,
    ) -> None:
        super().__init__(poll_interval=poll_interval)
        self.base_url = (base_url or os.environ.get(env.GCP_METADATA_URL) or LINK_LOCAL_METADATA)
        self.base_url = self.base_url.rstrip("/")
        self._timeout_s = _seconds(request_timeout, "request_timeout")
        self._long_poll_s = max(1, int(_seconds(long_poll, "long_poll")))
        self._session = _session()
        self._etag: str | None = None

    def check(self) -> PreemptionNotice | None:
        if self._etag is None:
            # A plain read first: a wait_for_change without an ETag would miss a preemption
            # that happened before the watcher started.
            params: dict[str, str] = {}
            timeout_s = self._timeout_s
        else:
            params = {
                "wait_for_change": "true",
                "last_etag": self._etag,
                "timeout_sec": str(self._long_poll_s),
            }
            timeout_s = self._long_poll_s + self._timeout_s
        response = self._session.get(
            self.base_url + self.PATH, params=params, headers=self.HEADERS, timeout=timeout_s
        )
        response.raise_for_status()
        self._etag = response.headers.get("ETag", self._etag or "")
        value = response.text.strip().upper()
        if value == "TRUE":
            deadline = datetime.now(timezone.utc) + self.WARNING
            return PreemptionNotice(source=self.source, deadline=deadline, detail="preempted=TRUE")
        if value != "FALSE":
            raise ValueError(f"unexpected instance/preempted value {response.text[:100]!r}")
        return None

    def probe(self, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> bool:
        try:
            response = self._session.get(
                self.base_url + self.PATH, headers=self.HEADERS, timeout=timeout.total_seconds()
            )
        except requests.RequestException:
            return False
        return response.ok and response.headers.get("Metadata-Flavor") == "Google"


class AzureScheduledEventsWatcher(PreemptionWatcher):
    """Azure Scheduled Events: a ``Preempt`` event for this VM (or any VM if no name is known)."""

    source = "azure"
    PATH: Final = "/metadata/scheduledevents"
    PARAMS: Final = {"api-version": "2020-07-01"}
    HEADERS: Final = {"Metadata": "true"}

    def __init__(
        self,
        *,
        base_url: str | None = None,
        poll_interval: timedelta = DEFAULT_POLL_INTERVAL,
        request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT,
        vm_name: str | None = None,
        event_types: Sequence[str] = ("Preempt",),
    ) -> None:
        super().__init__(poll_interval=poll_interval)
        self.base_url = (
            base_url or os.environ.get(env.AZURE_METADATA_URL) or LINK_LOCAL_METADATA
        ).rstrip("/")
        self._timeout_s = _seconds(request_timeout, "request_timeout")
        self._vm_name = vm_name
        self._event_types = frozenset(event_types)
        self._session = _session()

    def check(self) -> PreemptionNotice | None:
        response = self._session.get(
            self.base_url + self.PATH, params=self.PARAMS, headers=self.HEADERS,
            timeout=self._timeout_s,
        )
        response.raise_for_status()
        body = response.json()
        events = body.get("Events", []) if isinstance(body, dict) else None
        if not isinstance(events, list):
            raise ValueError(f"unexpected scheduledevents body {response.text[:200]!r}")
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") not in self._event_types:
                continue
            resources = event.get("Resources") or []
            if self._vm_name is not None and self._vm_name not in resources:
                continue
            deadline = _parse_http_date(str(event.get("NotBefore", "")))
            return PreemptionNotice(
                source=self.source, deadline=deadline, detail=json.dumps(event, sort_keys=True)
            )
        return None

    def probe(self, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> bool:
        try:
            response = self._session.get(
                self.base_url + self.PATH, params=self.PARAMS, headers=self.HEADERS,
                timeout=timeout.total_seconds(),
            )
            return response.ok and isinstance(response.json(), dict)
        except (requests.RequestException, ValueError):
            return False


class SigtermWatcher(PreemptionWatcher):
    """SIGTERM (Kubernetes pod deletion, spot drain) turned into a notice.

    :meth:`start` installs a handler in the main thread (it must be called there); the handler
    calls the callback once, in the main thread between bytecodes (keep it short: set an event),
    then chains to the handler installed before it if that was a Python callable (for example
    torch's agent, which turns SIGTERM into ``SignalException``). SIG_DFL is not chained: dying at
    once is exactly what the notice is meant to prevent. :meth:`stop` restores the previous handler.
    """

    source = "sigterm"

    def __init__(self, *, grace_period: timedelta | None = None) -> None:
        super().__init__()
        if grace_period is not None:
            _seconds(grace_period, "grace_period")
        self._grace = grace_period
        self._previous: Any = None
        self._installed = False

    def check(self) -> PreemptionNotice | None:
        return None  # push, not poll

    def probe(self, timeout: timedelta = DEFAULT_PROBE_TIMEOUT) -> bool:
        return True

    def start(self, callback: NoticeCallback) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "SigtermWatcher.start was called off the main thread (signal handlers can only "
                "be installed there); start it from the main thread."
            )
        with self._lock:
            if self._installed:
                raise RuntimeError("SigtermWatcher was already started")
            self._callback = callback
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True

    def ensure_installed(self) -> bool:
        """Put the handler back on top if someone replaced it; True if it had to.

        torch's ``PContext.start`` installs its own SIGTERM handler every time it starts workers,
        replacing this one: call this after each worker (re)start, in the main thread. The
        replacing handler becomes the one chained to.
        """
        if not self._installed or self._stop.is_set():
            return False
        current = signal.getsignal(signal.SIGTERM)
        if current == self._handle:
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return True

    def stop(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._stop.set()
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(ValueError, TypeError):
            if signal.getsignal(signal.SIGTERM) == self._handle:
                previous = self._previous if self._previous is not None else signal.SIG_DFL
                signal.signal(signal.SIGTERM, previous)
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        deadline = None if self._grace is None else datetime.now(timezone.utc) + self._grace
        self._deliver(PreemptionNotice(source=self.source, deadline=deadline, detail="SIGTERM"))
        previous = self._previous
        if callable(previous):
            previous(signum, frame)


class PreemptionMonitor:
    """Several watchers, one callback: the first notice from any of them wins; the rest stop."""

    def __init__(self, watchers: Sequence[PreemptionWatcher]) -> None:
        self.watchers = tuple(watchers)
        self._lock = threading.Lock()
        self._notice: PreemptionNotice | None = None
        self._event = threading.Event()
        self._callback: NoticeCallback | None = None

    @property
    def notice(self) -> PreemptionNotice | None:
        """The first notice heard, or None."""
        return self._notice

    def wait(self, timeout: timedelta | None = None) -> PreemptionNotice | None:
        """Block until a notice (or ``timeout``); returns it or None."""
        self._event.wait(None if timeout is None else timeout.total_seconds())
        return self._notice

    def start(self, callback: NoticeCallback | None = None) -> None:
        """Start every watcher; ``callback`` (optional) is called once with the first notice."""
        self._callback = callback
        for watcher in self.watchers:
            watcher.start(self._on_notice)

    def stop(self) -> None:
        """Stop every watcher (restores the SIGTERM handler when called in the main thread)."""
        for watcher in self.watchers:
            watcher.stop()

    def __enter__(self) -> PreemptionMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _on_notice(self, notice: PreemptionNotice) -> None:
        with self._lock:
            if self._notice is not None:
                return
            self._notice = notice
        self._event.set()
        if self._callback is not None:
            self._callback(notice)


def parse_watch_spec(text: str) -> tuple[str, ...]:
    """Validate a ``--preemption-watch`` value: ``none``, ``auto`` or a list of :data:`KINDS`.

    Raises:
        ConfigError: an unknown kind, or ``auto``/``none`` mixed with others.
    """
    items = tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))
    if not items or items == ("none",):
        return ()
    if items == ("auto",):
        return ("auto",)
    for item in items:
        if item not in KINDS:
            raise ConfigError(
                f"--preemption-watch ({text!r}) names an unknown source {item!r}; pass a "
                f"comma-separated subset of {','.join(KINDS)}, or auto, or none."
            )
    return items


def _make(kind: str, options: dict[str, Any]) -> PreemptionWatcher:
    if kind == "aws":
        return AwsSpotWatcher(base_url=options.get("aws_url"))
    if kind == "gcp":
        return GcpPreemptionWatcher(base_url=options.get("gcp_url"))
    if kind == "azure":
        return AzureScheduledEventsWatcher(base_url=options.get("azure_url"))
    return SigtermWatcher(grace_period=options.get("grace_period"))


def detect_watchers(
    kind: str,
    *,
    aws_url: str | None = None,
    gcp_url: str | None = None,
    azure_url: str | None = None,
    grace_period: timedelta | None = None,
    probe_timeout: timedelta = DEFAULT_PROBE_TIMEOUT,
) -> list[PreemptionWatcher]:
    """Build the watchers a ``--preemption-watch`` value asks for (not started).

    ``auto`` probes the three metadata services once, in parallel, each bounded by
    ``probe_timeout``, and keeps those that answer, plus ``sigterm`` always; on a machine outside
    any cloud it returns only the SIGTERM watcher within about ``probe_timeout``.

    Args:
        kind: ``none``, ``auto``, or a comma-separated subset of ``aws,gcp,azure,sigterm``.
        aws_url: IMDS base URL (default env ``ELASTIC_AWS_METADATA_URL`` or 169.254.169.254).
        gcp_url: GCP metadata base URL (default env ``ELASTIC_GCP_METADATA_URL`` or link-local).
        azure_url: Azure IMDS base URL (default env ``ELASTIC_AZURE_METADATA_URL`` or link-local).
        grace_period: Deadline a SIGTERM notice announces (the pod's grace period), or None.
        probe_timeout: Per-service probe budget for ``auto``.

    Raises:
        ConfigError: ``kind`` is not a valid value.
    """
    kinds = parse_watch_spec(kind)
    options: dict[str, Any] = {
        "aws_url": aws_url, "gcp_url": gcp_url, "azure_url": azure_url,
        "grace_period": grace_period,
    }
    if kinds != ("auto",):
        return [_make(k, options) for k in kinds]
    candidates = [_make(k, options) for k in ("aws", "gcp", "azure")]
    found = [False] * len(candidates)

    def probe(index: int) -> None:
        found[index] = candidates[index].probe(probe_timeout)

    threads = [
        threading.Thread(target=probe, args=(i,), name="preemption-probe", daemon=True)
        for i in range(len(candidates))
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + probe_timeout.total_seconds() + 1.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    watchers = [w for w, ok in zip(candidates, found, strict=True) if ok]
    logger.info("Preemption watchers detected: %s", [w.source for w in watchers] or "none")
    return [*watchers, _make("sigterm", options)]


def _parse_iso(text: str) -> datetime | None:
    if not text:
        return None
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _parse_http_date(text: str) -> datetime | None:
    if not text:
        return None
    try:
        parsed = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m launch.preemption``: wait for a notice on this node and print it as JSON.

    For operators checking that a node hears its cloud's notices, and for tests. Exits 0 with the
    notice on stdout, 1 if ``--timeout`` passes first, 2 on bad input.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m launch.preemption", description=main.__doc__)
    parser.add_argument("--watch", default=os.environ.get(env.PREEMPTION_WATCH, "auto"),
                        help="auto, none, or a comma-separated subset of aws,gcp,azure,sigterm.")
    parser.add_argument("--aws-url", default=None)
    parser.add_argument("--gcp-url", default=None)
    parser.add_argument("--azure-url", default=None)
    parser.add_argument("--grace-period", type=float, default=None,
                        help="Seconds a SIGTERM notice gives (the pod's grace period).")
    parser.add_argument("--timeout", type=float, default=None,
                        help="Give up after this many seconds (default: wait forever).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        grace = None if args.grace_period is None else timedelta(seconds=args.grace_period)
        watchers = detect_watchers(
            args.watch, aws_url=args.aws_url, gcp_url=args.gcp_url, azure_url=args.azure_url,
            grace_period=grace,
        )
    except ConfigError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    monitor = PreemptionMonitor(watchers)
    with monitor:
        monitor.start()
        print(json.dumps({"ready": [w.source for w in watchers]}), flush=True)
        timeout = None if args.timeout is None else timedelta(seconds=args.timeout)
        # Wait in short slices: the main thread must run to execute the SIGTERM handler.
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        notice = None
        while notice is None and (end is None or time.monotonic() < end):
            notice = monitor.wait(timedelta(milliseconds=100))
    if notice is None:
        return 1
    deadline = None if notice.deadline is None else notice.deadline.isoformat()
    print(json.dumps({"source": notice.source, "deadline": deadline, "detail": notice.detail}),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
