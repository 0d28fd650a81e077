"""A start-up check that etcd answers, so a wrong endpoint fails in seconds, not at join timeout.

Uses the project's etcd facade (``elastic.etcd.EtcdClient``) when it is importable; otherwise a
plain HTTP call to the v3 JSON gateway (``/v3/maintenance/status``), one attempt per endpoint
per round until the deadline.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Final

import requests
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from elastic.errors import EtcdUnavailableError

logger = logging.getLogger(__name__)

_PATH: Final = "/v3/maintenance/status"
_ATTEMPT_TIMEOUT_S: Final = 1.0


def _url(endpoint: str) -> str:
    return endpoint if endpoint.startswith(("http://", "https://")) else f"http://{endpoint}"


def _status_once(endpoints: list[str], attempt_timeout: float) -> None:
    errors = []
    for endpoint in endpoints:
        try:
            resp = requests.post(_url(endpoint) + _PATH, json={}, timeout=attempt_timeout)
        except requests.RequestException as exc:
            errors.append(f"{endpoint}: {type(exc).__name__}")
            continue
        if resp.status_code < 500:
            return  # even 401 (auth on) proves an etcd is listening there
        errors.append(f"{endpoint}: HTTP {resp.status_code}")
    raise ConnectionError("; ".join(errors))


def probe(endpoints: str, timeout: timedelta) -> None:
    """Return once any endpoint of ``endpoints`` answers; raise after ``timeout``.

    Raises:
        EtcdUnavailableError: nothing answered within ``timeout``.
    """
    items = [e.strip() for e in endpoints.split(",") if e.strip()]
    deadline_s = max(timeout.total_seconds(), 0.1)
    started = time.monotonic()
    attempt_timeout = min(_ATTEMPT_TIMEOUT_S, deadline_s)
    policy = Retrying(
        stop=stop_after_delay(deadline_s),
        wait=wait_fixed(0.25),
        retry=retry_if_exception_type(ConnectionError),
        reraise=True,
    )
    try:
        policy(_status_once, items, attempt_timeout)
    except ConnectionError as exc:
        raise EtcdUnavailableError(
            f"no etcd answered at ({', '.join(items)}) within "
            f"{time.monotonic() - started:.0f} s ({exc}); check --etcd / ELASTIC_ETCD_ENDPOINTS "
            "and that etcd is running."
        ) from exc
