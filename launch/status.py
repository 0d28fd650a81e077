"""``elastic-run status``: the current round, members, world size and their ages, and whether
the job is training.

Reads the job's membership through the runtime's ``read_job_status`` and prints it for an
operator. Only membership facts are printed: never endpoints' credentials or certificates.

The live part needs no etcd writes per step: it scrapes each agent's Prometheus endpoint
(``elastic-run --metrics-port``, :mod:`launch.metrics`) twice, ``--rate-interval`` apart, with
a short timeout, and shows the job's step rate, its last committed checkpoint and each node's
health (last step seen, worker restarts); a node whose scrape fails is shown as such. The
endpoints come from the nodes' records (:func:`metrics_targets`) or from ``--metrics``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from elastic import env
from elastic_errors import ConfigError, EtcdUnavailableError
from membership.keys import validate_job_id

EXIT_OK: Final = 0
EXIT_NOT_FOUND: Final = 1
EXIT_BAD_INPUT: Final = 2
EXIT_UNAVAILABLE: Final = 3


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``elastic-run status``."""
    parser = argparse.ArgumentParser(
        prog="elastic-run status", description="Show a job's rendezvous round and members."
    )
    parser.add_argument("--job-id", "--rdzv-id", dest="job_id", required=True)
    parser.add_argument(
        "--etcd", "--etcd-endpoints", "--rdzv-endpoint", dest="etcd",
        default=os.environ.get(env.ETCD_ENDPOINTS, ""),
        help=f"etcd endpoints host:port[,host:port...] (env {env.ETCD_ENDPOINTS}).",
    )
    parser.add_argument("--key-prefix", default="/elastic",
                        help="The job's --rdzv-conf key_prefix (default /elastic).")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="Seconds to wait for etcd (default 10).")
    parser.add_argument(
        "--metrics", default="",
        help="The agents' metrics endpoints host:port[,host:port...] (their --metrics-port), "
        "for the live part; default: from the nodes' records in etcd, where they have one.")
    parser.add_argument("--scrape-timeout", type=float, default=2.0,
                        help="Seconds to wait for one agent's /metrics (default 2).")
    parser.add_argument("--rate-interval", type=float, default=1.0,
                        help="Seconds between the two scrapes that measure the step rate "
                        "(default 1).")
    parser.epilog = (
        "TLS files and credentials come from ELASTIC_ETCD_CA_CERT, ELASTIC_ETCD_CERT, "
        "ELASTIC_ETCD_KEY, ELASTIC_ETCD_USERNAME and ELASTIC_ETCD_PASSWORD, as for the job. "
        "Exit codes: 0 shown; 1 the job has no live member; 2 bad input; 3 etcd unusable."
    )
    return parser


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _age(value: Any, now: float) -> str:
    if isinstance(value, datetime):
        value = value.timestamp()
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float):
        seconds = now - float(value)
    else:
        return "?"
    return f"{max(seconds, 0.0):.1f} s"


_SECRET_HINTS: Final = ("password", "token", "secret", "key", "cert")


def format_status(job_id: str, status: Any, *, now: float | None = None) -> str:
    """Render a job status (round, world size, members with their ages) as plain text.

    Args:
        job_id: the job id, for the heading.
        status: what ``read_job_status`` returned (a dataclass or mapping with ``round``,
            ``members`` and optionally ``world_size``); ``None`` when the job is unknown.
        now: the current time (epoch seconds), for the ages.
    """
    if status is None:
        return f"job {job_id}: no rendezvous state found (not started, or expired)."
    now = time.time() if now is None else now
    fields = _as_mapping(status)
    members = list(fields.get("members") or ())
    world = fields.get("world_size", len(members))
    expected = fields.get("expected_size") or 0
    formed = f" (formed with {expected}: a node was lost)" if expected > world else ""
    lines = [f"job {job_id}: round {fields.get('round', '?')}, world size {world}{formed}, "
             f"{len(members)} member(s)"]

    def order(member: Any) -> tuple[int, str]:
        info = _as_mapping(member)
        rank = info.get("group_rank")
        return (rank if isinstance(rank, int) else -1, str(info.get("node_id", member)))

    for member in sorted(members, key=order):
        info = _as_mapping(member)
        parts = []
        for name, value in info.items():
            if any(h in name.lower() for h in _SECRET_HINTS):
                continue
            if name in ("started_at", "joined_at", "last_seen", "age"):
                parts.append(f"{name.replace('_at', '')} age={_age(value, now)}")
            else:
                parts.append(f"{name}={value}")
        lines.append("  - " + " ".join(parts))
    return "\n".join(lines)


def _read(job_id: str, endpoints: str, timeout: float, key_prefix: str) -> Any:
    from membership.etcd import EtcdClient, config_from_env
    from membership.status import read_job_status

    limit = timedelta(seconds=timeout)
    client = EtcdClient(config_from_env(endpoints, request_timeout=limit, deadline=limit))
    try:
        return read_job_status(client, job_id, key_prefix=key_prefix)
    finally:
        client.close()


@dataclasses.dataclass(frozen=True, slots=True)
class NodeHealth:
    """What one agent's metrics endpoint said (``error`` set when it could not be scraped)."""

    name: str
    url: str
    error: str | None = None
    steps_per_s: float | None = None
    last_step: int | None = None
    last_step_age_s: float | None = None
    """Seconds since the newest step completed (by the node's clock)."""
    restarts: int | None = None
    last_committed: int | None = None
    world_size: int | None = None
    goodput: float | None = None
    changes: int | None = None


Samples = dict[str, float]
"""Sample name to value, summed over every label but ``job_id``/``node``."""


def scrape(url: str, timeout: float) -> tuple[str | None, Samples]:
    """``(node label, samples)`` of one ``/metrics`` endpoint.

    Raises:
        OSError: the endpoint did not answer within ``timeout`` s (or refused).
        ValueError: the answer is not Prometheus text.
    """
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode("utf-8", errors="replace")
    node: str | None = None
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            node = sample.labels.get("node", node)
            samples[sample.name] = samples.get(sample.name, 0.0) + float(sample.value)
    return node, samples


def _as_url(target: str) -> str:
    url = target if "://" in target else f"http://{target}"
    return url if urllib.parse.urlsplit(url).path not in ("", "/") else \
        url.rstrip("/") + "/metrics"


def node_health(
    targets: Sequence[tuple[str, str]], *, timeout: float = 2.0, interval: float = 1.0,
    clock: Callable[[], float] = time.monotonic, now: Callable[[], float] = time.time,
) -> list[NodeHealth]:
    """Scrapes every node's metrics twice, ``interval`` s apart, all nodes at once.

    Args:
        targets: ``(node name, metrics URL)``; an empty name is replaced by the node label
            the endpoint reports.
        timeout: Seconds one scrape may take.
        interval: Seconds between the two scrapes (0: one scrape, no step rate).
    """
    if not targets:
        return []

    def twice(name: str, url: str) -> NodeHealth:
        try:
            label, first = scrape(url, timeout)
            taken = clock()
            second = first
            if interval > 0:
                time.sleep(interval)
                label, second = scrape(url, timeout)
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return NodeHealth(name=name or url, url=url, error=f"unreachable ({reason})")
        elapsed = clock() - taken

        def value(key: str) -> float | None:
            return second.get(key)

        def whole(key: str) -> int | None:
            got = value(key)
            return None if got is None else int(got)

        rate = None
        if interval > 0 and elapsed > 0 and "elastic_run_steps_total" in second:
            rate = (second["elastic_run_steps_total"] - first.get("elastic_run_steps_total", 0.0)
                    ) / elapsed
        last_time = value("elastic_run_last_step_timestamp_seconds")
        steps = whole("elastic_run_steps_total")
        committed = whole("elastic_run_checkpoint_last_committed_step")
        return NodeHealth(
            name=name or label or url, url=url, steps_per_s=rate,
            last_step=whole("elastic_run_last_step") if steps else None,
            last_step_age_s=None if not steps or last_time is None else now() - last_time,
            restarts=whole("elastic_run_worker_restarts_total"),
            last_committed=committed if committed is not None and committed >= 0 else None,
            world_size=whole("elastic_run_world_size") if steps else None,
            goodput=value("elastic_run_goodput_ratio"),
            changes=whole("elastic_run_membership_changes_total"),
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(lambda t: twice(*t), targets))


def format_health(health: Sequence[NodeHealth]) -> str:
    """The live part of the status: the job's step rate and checkpoint, then each node."""
    if not health:
        return ("live: no metrics endpoint known (start the agents with --metrics-port and "
                "pass --metrics host:port,...).")
    ok = [h for h in health if h.error is None]
    rates = [h.steps_per_s for h in ok if h.steps_per_s is not None]
    committed = [h.last_committed for h in ok if h.last_committed is not None]
    worlds = [h.world_size for h in ok if h.world_size is not None]
    # Each node counts every step of the job once: the job's rate is the fastest node's.
    rate = f"{max(rates):.2f} steps/s" if rates else "step rate unknown"
    checkpoint = (f"last committed checkpoint at step {max(committed)}" if committed
                  else "no committed checkpoint seen")
    world = f", world size {max(worlds)}" if worlds else ""
    lines = [f"live: {rate}, {checkpoint}{world} ({len(ok)} of {len(health)} node(s) "
             "answered)"]
    for h in sorted(health, key=lambda h: h.name):
        if h.error is not None:
            lines.append(f"  - {h.name}: {h.error} [{h.url}]")
            continue
        parts = [f"{h.steps_per_s:.2f} steps/s" if h.steps_per_s is not None else "rate ?"]
        if h.last_step is None:
            parts.append("no step yet")
        else:
            age = "" if h.last_step_age_s is None else f" ({max(h.last_step_age_s, 0.0):.1f} s ago)"
            parts.append(f"last step {h.last_step}{age}")
        parts.append(f"restarts {h.restarts if h.restarts is not None else '?'}")
        if h.changes is not None:
            parts.append(f"membership changes {h.changes}")
        if h.goodput is not None:
            parts.append(f"goodput {h.goodput:.3f}")
        lines.append(f"  - {h.name}: " + ", ".join(parts))
    return "\n".join(lines)


def metrics_targets(status: Any) -> list[tuple[str, str]]:
    """Each node's metrics endpoint, from its node record (the address peers dial and the
    agent's ``--metrics-port``); ``--metrics`` names endpoints by hand."""
    if status is None:
        return []
    targets = []
    for member in _as_mapping(status).get("members") or ():
        info = _as_mapping(member)
        name = str(info.get("node_id") or f"{info.get('host', '?')}/{info.get('pid', '?')}")
        url = info.get("metrics_url")
        host = info.get("addr") or info.get("address") or info.get("host")
        if not url and info.get("metrics_port") and host:
            url = f"http://{host}:{info['metrics_port']}/metrics"
        if url:
            targets.append((name, str(url)))
    return targets


def main(argv: Iterable[str]) -> int:
    """Print the status of one job; return the exit code."""
    args = build_parser().parse_args(list(argv))
    if not args.etcd:
        return _fail(f"no etcd endpoint given; pass --etcd host:port or set "
                     f"{env.ETCD_ENDPOINTS}.", EXIT_BAD_INPUT)
    if args.timeout <= 0:
        return _fail(f"--timeout ({args.timeout:g}) must be positive.", EXIT_BAD_INPUT)
    if args.scrape_timeout <= 0:
        return _fail(f"--scrape-timeout ({args.scrape_timeout:g}) must be positive.",
                     EXIT_BAD_INPUT)
    if args.rate_interval < 0:
        return _fail(f"--rate-interval ({args.rate_interval:g}) must be 0 or more.",
                     EXIT_BAD_INPUT)
    try:
        validate_job_id(args.job_id)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    try:
        status = _read(args.job_id, args.etcd, args.timeout, args.key_prefix)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except (EtcdUnavailableError, ConnectionError) as exc:
        return _fail(str(exc), EXIT_UNAVAILABLE)
    if status is None:
        return _fail(
            f"job ({args.job_id}) has no live member in etcd ({args.etcd}); check --job-id "
            "(the job may also not have started yet, or have finished).", EXIT_NOT_FOUND,
        )
    print(format_status(args.job_id, status), flush=True)
    targets = [("", _as_url(t.strip())) for t in args.metrics.split(",") if t.strip()] \
        or metrics_targets(status)
    print(format_health(node_health(targets, timeout=args.scrape_timeout,
                                    interval=args.rate_interval)))
    return EXIT_OK


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"elastic-run: error: {message}\n")
    return code
