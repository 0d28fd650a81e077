"""``elastic-run status``: the current round, members, world size and their ages.

Reads the job's membership through the runtime's ``read_job_status`` and prints it for an
operator. Only membership facts are printed: never endpoints' credentials or certificates.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, Final

from elastic import env
from elastic.errors import ConfigError, EtcdUnavailableError

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
    from elastic.etcd import EtcdClient, config_from_env
    from elastic.rdzv.status import read_job_status

    limit = timedelta(seconds=timeout)
    client = EtcdClient(config_from_env(endpoints, request_timeout=limit, deadline=limit))
    try:
        return read_job_status(client, job_id, key_prefix=key_prefix)
    finally:
        client.close()


def main(argv: Iterable[str]) -> int:
    """Print the status of one job; return the exit code."""
    args = build_parser().parse_args(list(argv))
    if not args.etcd:
        return _fail(f"no etcd endpoint given; pass --etcd host:port or set "
                     f"{env.ETCD_ENDPOINTS}.", EXIT_BAD_INPUT)
    if args.timeout <= 0:
        return _fail(f"--timeout ({args.timeout:g}) must be positive.", EXIT_BAD_INPUT)
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
    print(format_status(args.job_id, status))
    return EXIT_OK


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"elastic-run: error: {message}\n")
    return code
