"""Turns parsed ``elastic-run`` arguments into a running ``NodeAgent`` and an exit code.

Mirrors ``torch.distributed.launcher.api.launch_agent`` (which hard-codes ``LocalElasticAgent``)
and reuses torch's own ``config_from_args`` for everything torchrun already knows how to build.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final

from elastic import env
from elastic.errors import EtcdUnavailableError
from elastic.eventlog import EventLog, process_started_at
from launch.cli import (
    ETCD_BACKENDS,
    EXIT_OK,
    EXIT_RENDEZVOUS,
    EXIT_WORKERS_FAILED,
    PROG,
)

logger = logging.getLogger(__name__)

GUARD_MODULE: Final = "launch.worker_guard"
_SHARE_STORE_ENV: Final = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def guarded_command(
    cmd: Callable[..., Any] | str, cmd_args: Sequence[str]
) -> tuple[Callable[..., Any] | str, list[str]]:
    """Route a torchrun worker command through ``launch.worker_guard``.

    ``python -u [-m] TARGET ARGS`` becomes ``python -u -m launch.worker_guard [-m] TARGET ARGS``
    and a ``--no-python`` executable ``X ARGS`` becomes ``python -u -m launch.worker_guard --exec
    X ARGS``. Function entrypoints (``--run-path``) run inside the agent's own process tree and
    are returned unchanged.
    """
    args = list(cmd_args)
    if not isinstance(cmd, str):
        return cmd, args
    python = os.getenv("PYTHON_EXEC", sys.executable)
    if cmd == python:
        if args[:1] == ["-u"]:
            args = args[1:]
        return python, ["-u", "-m", GUARD_MODULE, *args]
    return python, ["-u", "-m", GUARD_MODULE, "--exec", cmd, *args]


def _log_config(
    args: argparse.Namespace, config: Any, entrypoint: Any, cmd_args: list[str]
) -> None:
    rows = {
        "script": args.training_script,
        "nodes (min:max)": f"{config.min_nodes}:{config.max_nodes}",
        "nproc_per_node": config.nproc_per_node,
        "job id": config.run_id,
        "rdzv backend": config.rdzv_backend,
        "rdzv endpoint": config.rdzv_endpoint,
        "rdzv conf": config.rdzv_configs,
        "max_restarts (crashes only)": config.max_restarts,
        "monitor_interval": config.monitor_interval,
        "exit_barrier_timeout": args.exit_barrier_timeout,
        "failure_settle_timeout": args.failure_settle_timeout,
        "shutdown_timeout": config.shutdown_timeout,
        "worker command": " ".join(str(a) for a in [entrypoint, *cmd_args]),
    }
    width = max(len(k) for k in rows)
    table = "\n".join(f"  {k:<{width}} : {v}" for k, v in rows.items())
    logger.info("%s effective configuration:\n%s", PROG, table)


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()
    return code


def _watchers(args: argparse.Namespace) -> list[Any]:
    from launch.preemption import detect_watchers

    grace = args.sigterm_grace_period
    return detect_watchers(
        args.preemption_watch, aws_url=args.aws_metadata_url, gcp_url=args.gcp_metadata_url,
        azure_url=args.azure_metadata_url,
        grace_period=None if grace is None else timedelta(seconds=grace),
    )


def _without_sigterm(signals: str) -> str:
    # torch installs its SIGTERM handler (kill the workers, exit 143) on every worker start;
    # with the SIGTERM watcher the signal is a preemption notice instead.
    return ",".join(s for s in signals.split(",") if s.strip().upper() != "SIGTERM")


def _inplace_options(
    args: argparse.Namespace, handler: Any, rdzv_configs: dict[str, Any], had_password: bool
) -> Any:
    """The agent's in-place options, or ``None`` where in-place mode cannot work (restart).

    ``auto`` falls back silently (restart is what the job would get anyway); an explicit
    ``inplace`` says why it cannot be honoured.
    """
    if args.elastic_mode not in ("auto", "inplace"):
        return None
    from launch.agent import InPlaceOptions

    auto = args.elastic_mode == "auto"
    say = logger.info if auto else logger.warning
    registry = getattr(handler, "registry", None)
    if registry is None:
        say("--elastic-mode %s needs the elastic-etcd-v3 rendezvous for in-place "
            "reconfiguration (got %s); using restart mode.", args.elastic_mode,
            args.rdzv_backend)
        return None
    if had_password:
        # The workers would need the password to reach etcd, and it is kept from them.
        say("--elastic-mode %s: in-place reconfiguration is not used with etcd password "
            "authentication (workers do not get the password); using restart mode.",
            args.elastic_mode)
        return None
    return InPlaceOptions(
        client=registry.client, key_prefix=str(rdzv_configs.get("key_prefix", "/elastic")),
        ttl=int(args.inplace_ttl), build_timeout=float(args.inplace_build_timeout), auto=auto,
    )


def run(args: argparse.Namespace) -> int:
    """Run the node agent described by validated ``args``; return the process exit code."""
    from torch.distributed.elastic import events as torch_events
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousError,
    )
    from torch.distributed.run import config_from_args

    from launch.agent import NodeAgent
    from launch.departure import PlannedDeparture
    from launch.etcd_probe import probe
    from launch.preemption import PreemptionMonitor

    # pytorch#135712: a TCPStore shared across rounds hands new workers a dead worker's address.
    # Without sharing, the rank-0 worker hosts a fresh store each round (port agreed via etcd).
    if os.environ.get(_SHARE_STORE_ENV) == "0":
        logger.warning("Ignoring %s=0: a shared agent store hangs restarts.", _SHARE_STORE_ENV)
    os.environ[_SHARE_STORE_ENV] = "1"
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")

    config, cmd, cmd_args = config_from_args(args)
    is_etcd = args.rdzv_backend in ETCD_BACKENDS
    if is_etcd:
        try:
            probe(args.rdzv_endpoint, timedelta(seconds=args.etcd_connect_timeout),
                  config.rdzv_configs)
        except EtcdUnavailableError as exc:
            return _fail(str(exc), EXIT_RENDEZVOUS)
    entrypoint, worker_args = guarded_command(cmd, cmd_args)
    _log_config(args, config, entrypoint, worker_args)
    watchers = _watchers(args)
    if any(w.source == "sigterm" for w in watchers):
        config.signals_to_handle = _without_sigterm(config.signals_to_handle)
    if args.events_dir:
        os.environ[env.EVENTS_DIR] = args.events_dir  # the workers log their steps there too
    events = EventLog(args.events_dir, job=config.run_id, source="agent")
    # [metrics hook] The workers report to this agent over a local socket; with
    # --metrics-port the node's Prometheus series are one more sink of its event log.
    from launch.telemetry import NodeTelemetry

    telemetry = NodeTelemetry(events, metrics_port=args.metrics_port,
                              metrics_host=args.metrics_host).start()
    os.environ.update(telemetry.worker_env)  # torch copies it into every worker

    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    try:
        handler = rdzv_registry.get_rendezvous_handler(params)
    except (RendezvousError, ValueError, RuntimeError) as exc:
        return _fail(f"could not set up the rendezvous ({exc})", EXIT_RENDEZVOUS)

    had_password = os.environ.pop(env.ETCD_PASSWORD, None) is not None
    if had_password:
        # The handler's client holds the password now; torch copies this environment into
        # every worker, and training code has no use for it (nor should a crash dump show it).
        logger.info("%s is not passed on to the workers.", env.ETCD_PASSWORD)

    if handler.use_agent_store:
        logger.warning(
            "The %s rendezvous handler shares one agent store across rounds; worker restarts "
            "may hang (pytorch#135712).", config.rdzv_backend,
        )

    inplace = _inplace_options(args, handler, config.rdzv_configs, had_password)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(worker_args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = NodeAgent(
        spec,
        config.logs_specs,  # type: ignore[arg-type]
        start_method=config.start_method,
        exit_barrier_timeout=args.exit_barrier_timeout,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=int(config.shutdown_timeout or 30),
        failure_settle_timeout=args.failure_settle_timeout,
        etcd_endpoints=config.rdzv_endpoint if is_etcd else None,
        events=events,
        drain_timeout=timedelta(seconds=args.preemption_drain_timeout),
        inplace=inplace,
    )
    events.record(
        "agent_started", min_nodes=config.min_nodes, max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node, max_restarts=config.max_restarts,
        preemption_watch=[w.source for w in watchers],
        launched_at=process_started_at(),
    )
    monitor = PreemptionMonitor(watchers)
    monitor.start(agent.request_departure)  # main thread: the SIGTERM watcher needs it

    shutdown_rdzv = True
    started = time.monotonic()
    outcome, code = "failed", EXIT_WORKERS_FAILED
    try:
        metrics.initialize_metrics(metrics.api.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            msg = ChildFailedError(name=args.training_script, failures=result.failures)
            sys.stderr.write(str(msg.format_msg()) + "\n")  # type: ignore[no-untyped-call]
            return _fail(
                f"the workers failed and no restarts are left (--max-restarts "
                f"{config.max_restarts}; {agent.membership_restarts} membership changes were "
                "not charged).",
                EXIT_WORKERS_FAILED,
            )
        logger.info(
            "Workers finished after %.1f s (%s membership changes, %s restarts left).",
            time.monotonic() - started, agent.membership_restarts, agent.remaining_restarts,
        )
        events.record("job_finished", round=agent.round)
        _mark_finished(handler, agent.round)
        outcome, code = "succeeded", EXIT_OK
        return EXIT_OK
    except PlannedDeparture as exc:
        # Left on a preemption notice: not a failure, and the rendezvous stays open.
        shutdown_rdzv = False
        logger.info("Left the job on a %s preemption notice (workers %s).", exc.notice.source,
                    "drained" if exc.drained else "killed")
        outcome, code = "departed", EXIT_OK
        return EXIT_OK
    except SignalException as exc:
        # As torch: leave the rendezvous open so the other nodes can go on without this one.
        shutdown_rdzv = False
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        outcome, code = "signal", 128 + int(exc.sigval)
        return code
    except RendezvousClosedError as exc:
        note = _finished_note(handler)
        if note is None:
            torch_events.record(agent.get_event_failed(), config.event_log_handler)
            outcome, code = "rendezvous_error", EXIT_RENDEZVOUS
            return _fail(f"the rendezvous failed ({type(exc).__name__}: {exc})",
                         EXIT_RENDEZVOUS)
        # A node that came as the job ended (a replacement started late): nothing to do.
        shutdown_rdzv = False
        logger.info("Job %s already finished (round %s); this node has nothing to do. Start "
                    "a new job with another --job-id.", config.run_id, note.get("round"))
        outcome, code = "already_finished", EXIT_OK
        return EXIT_OK
    except (RendezvousError, EtcdUnavailableError) as exc:
        # Closing the rendezvous needs the etcd that just failed us: don't wait on it again.
        shutdown_rdzv = not isinstance(exc, (RendezvousConnectionError, EtcdUnavailableError))
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        outcome, code = "rendezvous_error", EXIT_RENDEZVOUS
        return _fail(f"the rendezvous failed ({type(exc).__name__}: {exc})", EXIT_RENDEZVOUS)
    finally:
        monitor.stop()
        events.record("agent_exited", round=agent.round, outcome=outcome, exit_code=code)
        telemetry.close()  # [metrics hook]
        events.close()  # [metrics hook] a URL log puts its last records (bounded wait)
        if args.events_dir:
            from launch.goodput import write_summary

            write_summary(args.events_dir, config.run_id)  # never raises
        if shutdown_rdzv:
            try:
                handler.shutdown()
            except Exception:  # the job's outcome is already decided; report, don't mask it
                logger.warning("Could not close the rendezvous cleanly.", exc_info=True)


def _mark_finished(handler: Any, round_: int | None) -> None:
    """Records the job's success in etcd (our handler only), for nodes that come later."""
    mark = getattr(handler, "mark_finished", None)
    if mark is None:
        return
    try:
        mark({"round": round_, "time": time.time()})
    except Exception:  # the job succeeded either way; a late node then reports a closed rdzv
        logger.warning("Could not record the end of the job in etcd.", exc_info=True)


def _finished_note(handler: Any) -> dict[str, Any] | None:
    """The note of a job that finished, if ``handler`` can tell (our etcd handler)."""
    finished = getattr(handler, "finished", None)
    if finished is None:
        return None
    try:
        note = finished()
    except Exception:
        logger.warning("Could not read whether the job finished.", exc_info=True)
        return None
    return note if isinstance(note, dict) else None
