"""The ``elastic-run`` command line.

``elastic-run`` accepts every ``torchrun`` flag and ``PET_*`` environment variable (the parser is
torch's own ``get_args_parser()``, extended), plus:

* ``--min-nodes N`` / ``--max-nodes M``: the two halves of ``--nnodes MIN:MAX``;
* ``--etcd ENDPOINTS`` (or ``ELASTIC_ETCD_ENDPOINTS``): ``host:port[,host:port...]``, an alias of
  ``--rdzv-endpoint``;
* ``--job-id ID`` (or ``ELASTIC_RUN_ID``): an alias of ``--rdzv-id``;
* ``--standalone``: start an embedded etcd on free loopback ports (killed with the launcher)
  instead of torch's single-node c10d store;
* ``--max-restarts N`` (default 3) and ``--restart-window S`` (default 3600): each node's
  crash budget (:mod:`launch.budget`); ``--etcd-connect-timeout``: see ``--help``;
* ``--preemption-watch`` (and the metadata URL and drain flags): leave the job on a spot
  preemption notice (see :mod:`launch.preemption`);
* ``--events-dir DIR|URL`` (or ``ELASTIC_EVENTS_DIR``): the job event log (:mod:`elastic.eventlog`),
  a local directory or any fsspec URL (``s3://...``); ``--events-copy DIR`` (or
  ``ELASTIC_EVENTS_COPY``) also appends the agent's records to a local file as it records them;
* ``--metrics-port PORT`` (or ``ELASTIC_METRICS_PORT``) and ``--metrics-host``: serve the node's
  Prometheus metrics at ``/metrics`` (:mod:`launch.metrics`);
* ``--elastic-mode auto|inplace|restart`` (or ``ELASTIC_MODE``), ``--inplace-ttl``,
  ``--inplace-build-timeout``, ``--hang-timeout``, ``--hang-factor``: survivors reconfigure in
  place (:mod:`elastic.inplace`) or every worker restarts on a membership change; ``auto``
  (the default) runs every ``ElasticLoop`` script in place and restarts the others.

The rendezvous is elastic-run's own protocol on etcd (:mod:`membership`); torchrun users get
the same protocol with ``--rdzv-backend etcd-v3``. Three more forms:

* ``elastic-run status --job-id ID [--etcd ENDPOINTS]`` prints the job's current round and members;
* ``elastic-run goodput EVENTS_DIR`` prints the goodput report of an event log;
* ``elastic-run --serve-etcd [--etcd-binary PATH]`` runs only an embedded etcd until interrupted.

Exit codes: 0 success; 1 the workers failed (restarts used up); 2 bad input; 3 etcd or the
rendezvous could not be used; 128+N the launcher was stopped by signal N.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Final

from elastic import env
from elastic_errors import ConfigError, ElasticError
from launch.budget import DEFAULT_MAX_RESTARTS, DEFAULT_WINDOW_S
from launch.exit_codes import EXIT_BAD_INPUT, EXIT_OK, EXIT_RENDEZVOUS, PROG
from membership.keys import validate_job_id

logger = logging.getLogger(__name__)

DEFAULT_BACKEND: Final = "elastic-etcd-v3"
ETCD_BACKENDS: Final = frozenset({"etcd-v3", "elastic-etcd-v3"})


def _find_action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    for action in parser._actions:
        if action.dest == dest:
            return action
    raise LookupError(f"torchrun's parser has no option with dest {dest!r}")


def build_parser() -> argparse.ArgumentParser:
    """Return torch's ``torchrun`` parser extended with elastic-run's flags and defaults."""
    # Imported here: torch.distributed.run pulls in most of torch (about a second).
    from torch.distributed.argparse_util import env as env_action
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG
    parser.description = "Fault-tolerant elastic launcher for PyTorch (a superset of torchrun)."

    backend = _find_action(parser, "rdzv_backend")
    backend.default = os.environ.get("PET_RDZV_BACKEND", DEFAULT_BACKEND)
    backend.help = f"Rendezvous backend (default: {DEFAULT_BACKEND}, etcd v3)."
    standalone = _find_action(parser, "standalone")
    standalone.help = (
        "Start an embedded etcd on free loopback ports (killed with this launcher) and use it "
        "for the rendezvous; for single-machine runs."
    )
    monitor = _find_action(parser, "monitor_interval")
    monitor.default = float(os.environ.get("PET_MONITOR_INTERVAL", "0.1"))
    restarts = _find_action(parser, "max_restarts")
    restarts.default = int(os.environ.get("PET_MAX_RESTARTS", DEFAULT_MAX_RESTARTS))
    restarts.help = (f"Worker crashes each node absorbs within --restart-window (default "
                     f"{DEFAULT_MAX_RESTARTS}); a node past it leaves the job, which goes on "
                     "with the other nodes. Membership changes are never counted.")

    group = parser.add_argument_group("elastic-run")
    group.add_argument(
        "--min-nodes", "--min_nodes", action=env_action, type=int, default=None,
        help="Minimum number of nodes (the MIN of --nnodes MIN:MAX).",
    )
    group.add_argument(
        "--max-nodes", "--max_nodes", action=env_action, type=int, default=None,
        help="Maximum number of nodes (the MAX of --nnodes MIN:MAX).",
    )
    group.add_argument(
        "--etcd", "--etcd-endpoints", dest="etcd", type=str,
        default=os.environ.get(env.ETCD_ENDPOINTS, ""),
        help=f"etcd endpoints host:port[,host:port...] (env {env.ETCD_ENDPOINTS}); "
        "same as --rdzv-endpoint.",
    )
    group.add_argument(
        "--job-id", "--job_id", dest="job_id", type=str,
        default=os.environ.get(env.RUN_ID, ""),
        help=f"Job id shared by every node of the job (env {env.RUN_ID}); same as --rdzv-id.",
    )
    group.add_argument(
        "--etcd-binary", dest="etcd_binary", type=str, default=os.environ.get(env.ETCD_BINARY),
        help=f"etcd binary for --standalone (env {env.ETCD_BINARY}; default: etcd on PATH).",
    )
    group.add_argument(
        "--etcd-connect-timeout", dest="etcd_connect_timeout", type=float, default=10.0,
        help="Seconds to wait for etcd to answer at start before giving up (default 10).",
    )
    group.add_argument(
        "--restart-window", dest="restart_window", type=float,
        default=float(os.environ.get("ELASTIC_RESTART_WINDOW", DEFAULT_WINDOW_S)),
        help="Seconds a worker crash counts against its node's --max-restarts budget "
        f"(default {DEFAULT_WINDOW_S:g}).",
    )
    for obsolete in ("--exit-barrier-timeout", "--failure-settle-timeout"):
        group.add_argument(obsolete, dest=obsolete.strip("-").replace("-", "_"), type=float,
                           default=None, help=argparse.SUPPRESS)
    _add_preemption_flags(group)
    group.add_argument(
        "--elastic-mode", dest="elastic_mode", type=str,
        default=os.environ.get(env.MODE) or "auto",
        help=f"How membership changes are handled (env {env.MODE}): 'auto' (default: in place "
        "for every script that uses ElasticLoop, restart for the others), 'inplace' (every "
        "script is treated as in-place capable) or 'restart' (every worker restarts from the "
        "last checkpoint).",
    )
    group.add_argument(
        "--warm-standby", dest="warm_standby", type=str,
        default=os.environ.get(env.WARM_STANDBY) or "auto",
        help=f"'auto' (default), 'on' or 'off' (env {env.WARM_STANDBY}): keep one started "
        "interpreter per worker slot, torch imported, and start restarted workers in it "
        "instead of a cold process (no CUDA is initialised before a worker starts in it). "
        "'auto' drops them once the node's workers reconfigure in place (only a crashed "
        "worker restarts then, and nobody waits for it); 'on' keeps them then too.",
    )
    group.add_argument(
        "--memory-checkpoints", dest="memory_checkpoints", type=str,
        default=os.environ.get(env.MEMORY_CHECKPOINTS) or "on",
        help=f"'on' (default) or 'off' (env {env.MEMORY_CHECKPOINTS}): keep each committed "
        "CheckpointManager save in this node's host memory and one peer node's, and restore "
        "from there when it is storage's newest.",
    )
    group.add_argument(
        "--inplace-ttl", dest="inplace_ttl", type=int,
        default=int(os.environ.get("ELASTIC_INPLACE_TTL", "3")),
        help="TTL in seconds of each node's etcd lease, i.e. how long a silent host goes "
        "unnoticed, and how long a silent worker may stay quiet (default 3; a crashed worker "
        "or a node whose processes died is noticed at once).",
    )
    group.add_argument(
        "--hang-timeout", dest="hang_timeout", type=float,
        default=float(os.environ.get(env.HANG_TIMEOUT) or 10.0),
        help="In place: a worker that every other worker has waited for in a step's "
        "collective for this long (or --hang-factor median step times, if longer) is evicted "
        "and replaced (default 10).",
    )
    group.add_argument(
        "--hang-factor", dest="hang_factor", type=float,
        default=float(os.environ.get(env.HANG_FACTOR) or 10.0),
        help="In place: the hang threshold in median step times (default 10).",
    )
    group.add_argument(
        "--inplace-build-timeout", dest="inplace_build_timeout", type=float, default=10.0,
        help="In-place mode: seconds a new world's process groups wait for every member "
        "before the next world is proposed (default 10).",
    )
    return parser


def _add_preemption_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--preemption-watch", dest="preemption_watch", type=str,
        default=os.environ.get(env.PREEMPTION_WATCH, "none"),
        help=f"Preemption notices to act on (env {env.PREEMPTION_WATCH}): none (default), "
        "auto (probe the AWS, GCP and Azure metadata services, plus SIGTERM), or a "
        "comma-separated subset of aws,gcp,azure,sigterm. On a notice this node drains its "
        "workers (final checkpoint), leaves the rendezvous and exits 0.",
    )
    for cloud, name in (("aws", env.AWS_METADATA_URL), ("gcp", env.GCP_METADATA_URL),
                        ("azure", env.AZURE_METADATA_URL)):
        group.add_argument(
            f"--{cloud}-metadata-url", dest=f"{cloud}_metadata_url", type=str,
            default=os.environ.get(name) or None,
            help=f"Base URL of the {cloud.upper()} metadata service (env {name}; default "
            "http://169.254.169.254).",
        )
    group.add_argument(
        "--preemption-drain-timeout", dest="preemption_drain_timeout", type=float, default=60.0,
        help="On a notice, the longest the workers get to stop and write a final checkpoint; "
        "shortened to fit the notice's deadline (default 60).",
    )
    group.add_argument(
        "--sigterm-grace-period", dest="sigterm_grace_period", type=float, default=None,
        help="Seconds between SIGTERM and SIGKILL (the pod's terminationGracePeriodSeconds), "
        "the deadline a SIGTERM notice gives (default: no deadline).",
    )
    group.add_argument(
        "--events-dir", dest="events_dir", type=str,
        default=os.environ.get(env.EVENTS_DIR) or None,
        help=f"Write the job event log (JSON lines) under this directory or fsspec URL, e.g. "
        f"s3://bucket/job/events (env {env.EVENTS_DIR}; S3 endpoint and keys from the "
        f"environment: FSSPEC_S3_ENDPOINT_URL, AWS_*); read it with '{PROG} goodput DIR'.",
    )
    group.add_argument(
        "--events-copy", dest="events_copy", type=str,
        default=os.environ.get(env.EVENTS_COPY) or None,
        help=f"Also append every record this agent logs to a file of its own under this local "
        f"directory, on disk as it is recorded: a local copy of what --events-dir gets, to "
        f"check a remote log against (env {env.EVENTS_COPY}; default: off).",
    )
    group.add_argument(
        "--metrics-port", dest="metrics_port", type=int,
        default=_env_int(env.METRICS_PORT),
        help=f"Serve this node's Prometheus metrics at http://HOST:PORT/metrics (env "
        f"{env.METRICS_PORT}; default: off).",
    )
    group.add_argument(
        "--metrics-host", dest="metrics_host", type=str,
        default=os.environ.get(env.METRICS_HOST, ""),
        help=f"Address the metrics endpoint binds (env {env.METRICS_HOST}; default: every "
        "IPv4 interface; '::' for IPv6).",
    )


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} ({text!r}) is not a port number; set it to an integer "
                          "such as 9400, or unset it.") from None


def parse_endpoints(text: str) -> list[str]:
    """Split and validate ``host:port[,host:port...]``; raises ConfigError on bad input."""
    from membership.etcd import parse_endpoints as parse

    # torchrun's --rdzv-endpoint is host:port; TLS is selected with --rdzv-conf protocol=https.
    return [e.split("://", 1)[-1] for e in parse(text)]


def _resolve_nodes(args: argparse.Namespace) -> None:
    nnodes = str(args.nnodes)
    parts = nnodes.split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(
            f"--nnodes ({nnodes!r}) is not N or MIN:MAX; pass for example --nnodes 2:4."
        )
    lo, hi = int(parts[0]), int(parts[-1])
    min_nodes = lo if args.min_nodes is None else int(args.min_nodes)
    if args.max_nodes is not None:
        max_nodes = int(args.max_nodes)
    elif args.min_nodes is not None:
        max_nodes = max(hi, min_nodes)
    else:
        max_nodes = hi
    if min_nodes < 1:
        raise ConfigError(f"--min-nodes ({min_nodes}) must be at least 1.")
    if min_nodes > max_nodes:
        raise ConfigError(
            f"--min-nodes ({min_nodes}) must not exceed --max-nodes ({max_nodes}); "
            "pass MIN <= MAX."
        )
    args.min_nodes, args.max_nodes = min_nodes, max_nodes
    args.nnodes = f"{min_nodes}:{max_nodes}"


def _resolve_rendezvous(args: argparse.Namespace) -> None:
    if args.etcd and args.rdzv_endpoint and args.etcd != args.rdzv_endpoint:
        raise ConfigError(
            f"--etcd ({args.etcd}) and --rdzv-endpoint ({args.rdzv_endpoint}) disagree; "
            "pass only one of them."
        )
    args.rdzv_endpoint = args.rdzv_endpoint or args.etcd
    if args.job_id and args.rdzv_id not in ("none", "", args.job_id):
        raise ConfigError(
            f"--job-id ({args.job_id}) and --rdzv-id ({args.rdzv_id}) disagree; "
            "pass only one of them."
        )
    if args.job_id:
        args.rdzv_id = args.job_id
    if args.rdzv_id not in ("none", ""):
        # The rendezvous names etcd keys after it: refused here, before anything starts.
        validate_job_id(args.rdzv_id)
    if args.standalone:
        args.rdzv_backend = DEFAULT_BACKEND
        if args.rdzv_id in ("none", ""):
            args.rdzv_id = f"standalone-{uuid.uuid4().hex[:12]}"
        return
    if args.rdzv_backend not in ETCD_BACKENDS:
        raise ConfigError(
            f"--rdzv-backend ({args.rdzv_backend}) is not elastic-run's; its agent speaks its "
            "own etcd protocol, so drop the flag (torch's backends work with torchrun)."
        )
    if args.rdzv_backend in ETCD_BACKENDS:
        if not args.rdzv_endpoint:
            raise ConfigError(
                "no etcd endpoint given; pass --etcd host:port, set "
                f"{env.ETCD_ENDPOINTS}, or use --standalone on a single machine."
            )
        args.rdzv_endpoint = ",".join(parse_endpoints(args.rdzv_endpoint))
        if args.rdzv_id in ("none", ""):
            logger.warning(
                "No --job-id given: using %r, which every job without one shares; pass "
                "--job-id to keep concurrent jobs apart.", "none",
            )
            args.rdzv_id = "none"


def _check_nproc(args: argparse.Namespace) -> None:
    value = str(args.nproc_per_node)
    if value in ("auto", "cpu", "gpu", "xpu"):
        return
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"--nproc-per-node ({value}) must be a positive number of workers per node (or "
            "auto, cpu, gpu); pass for example --nproc-per-node 1."
        )


def _check_script(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.module:
        return  # resolved by the worker's own interpreter (its sys.path may differ)
    if args.no_python:
        if shutil.which(script) is None:
            raise ConfigError(
                f"executable ({script}) not found or not executable; check the path."
            )
        return
    if not os.path.isfile(script):
        raise ConfigError(f"training script ({script}) does not exist; check the path.")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and validate the command line.

    Raises:
        ConfigError: a value is invalid (the message is one sentence naming it).
        SystemExit: argparse's own usage errors and ``--help``.
    """
    args = build_parser().parse_args(list(argv))
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts ({args.max_restarts}) must be at least 0.")
    if args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval ({args.monitor_interval}) must be positive.")
    if args.elastic_mode not in ("auto", "inplace", "restart"):
        raise ConfigError(
            f"--elastic-mode ({args.elastic_mode!r}) must be 'auto', 'inplace' or 'restart'."
        )
    if args.warm_standby not in ("auto", "on", "off"):
        raise ConfigError(
            f"--warm-standby ({args.warm_standby!r}) must be 'auto', 'on' or 'off'.")
    if args.memory_checkpoints not in ("on", "off"):
        raise ConfigError(
            f"--memory-checkpoints ({args.memory_checkpoints!r}) must be 'on' or 'off'.")
    if args.inplace_ttl < 1:
        raise ConfigError(f"--inplace-ttl ({args.inplace_ttl}) must be at least 1 second.")
    for name in ("exit_barrier_timeout", "failure_settle_timeout"):
        if getattr(args, name) is not None:
            logger.warning("--%s is no longer used (elastic-run's agent does not need it); "
                           "ignoring it.", name.replace("_", "-"))
    _check_nproc(args)
    for name in ("inplace_build_timeout", "etcd_connect_timeout", "restart_window",
                 "hang_timeout", "hang_factor",
                 "preemption_drain_timeout", "sigterm_grace_period"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} ({getattr(args, name)}) must be positive.")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port ({args.metrics_port}) must be a port number from 0 "
                          "to 65535 (0: any free port).")
    from launch.preemption import parse_watch_spec

    parse_watch_spec(args.preemption_watch)  # an unknown source is bad input, before etcd
    _resolve_nodes(args)
    _resolve_rendezvous(args)
    _check_script(args)
    return args


@contextlib.contextmanager
def _standalone_etcd(args: argparse.Namespace) -> Iterator[None]:
    if not args.standalone:
        yield
        return
    from launch.etcd_server import (  # type: ignore[import-not-found]
        EmbeddedEtcd,
        find_etcd_binary,
    )

    binary = find_etcd_binary(args.etcd_binary)
    with EmbeddedEtcd(binary=binary) as server:
        args.rdzv_endpoint = server.endpoint
        logger.info("Standalone etcd at %s (job id %s).", server.endpoint, args.rdzv_id)
        yield


def _serve_etcd(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} --serve-etcd")
    parser.add_argument("--serve-etcd", action="store_true")
    parser.add_argument("--etcd-binary", default=os.environ.get(env.ETCD_BINARY))
    parser.add_argument("--etcd-data-dir", default=None)
    parser.add_argument("--etcd-host", default="127.0.0.1")
    parser.add_argument("--etcd-port", type=int, default=0)
    args = parser.parse_args(list(argv))
    import threading

    from launch.etcd_server import (  # type: ignore[import-not-found]
        EmbeddedEtcd,
        find_etcd_binary,
    )

    binary = find_etcd_binary(args.etcd_binary)
    with EmbeddedEtcd(
        binary=binary, data_dir=args.etcd_data_dir, host=args.etcd_host,
        client_port=args.etcd_port,
    ) as server:
        print(f"etcd serving at {server.endpoint}; Ctrl-C stops it.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return EXIT_OK


def _configure_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("LOGLEVEL", "INFO").upper(),
            format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        )


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()
    return code


def main(argv: list[str] | None = None) -> int:
    """Run ``elastic-run`` with ``argv`` (default: ``sys.argv[1:]``) and return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _configure_logging()
    try:
        if argv and argv[0] == "status":
            from launch.status import main as status_main

            return status_main(argv[1:])
        if argv and argv[0] == "goodput":
            from launch.goodput import main as goodput_main

            return goodput_main(argv[1:])
        if "--serve-etcd" in argv:
            return _serve_etcd(argv)
        args = parse_args(argv)
        from launch.runner import run

        with _standalone_etcd(args):
            return run(args)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
    except FileNotFoundError as exc:  # e.g. no etcd binary for --standalone
        return _fail(str(exc), EXIT_BAD_INPUT)
    except ElasticError as exc:  # e.g. the embedded etcd did not become ready
        return _fail(str(exc), EXIT_RENDEZVOUS)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
