"""Turns parsed ``elastic-run`` arguments into a running :class:`~launch.node_agent.NodeAgent`.

torch's own ``config_from_args`` still parses what torchrun knows (the script, its arguments,
``--nproc-per-node``, node counts); everything after that is elastic-run's: the etcd client,
the node agent, preemption watchers, and the exit code with its one-sentence reason.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Final

from elastic import env
from elastic.contract.records import RecordError
from elastic.eventlog import EventLog, FileSink, process_started_at
from elastic_errors import ConfigError, EtcdUnavailableError
from launch.exit_codes import EXIT_RENDEZVOUS, PROG

logger = logging.getLogger(__name__)

GUARD_MODULE: Final = "launch.worker_guard"

# Variables a worker must never see: it does not talk to etcd, and a crash dump or a
# debugging print of os.environ must not leak them.
_AGENT_ONLY: Final = (env.ETCD_USERNAME, env.ETCD_PASSWORD, env.ETCD_CA_CERT, env.ETCD_CERT,
                      env.ETCD_KEY, env.ETCD_ENDPOINTS)


def guarded_command(
    cmd: Callable[..., Any] | str, cmd_args: Sequence[str]
) -> tuple[str, list[str]]:
    """Routes a torchrun worker command through ``launch.worker_guard``.

    ``python -u [-m] TARGET ARGS`` becomes ``python -u -m launch.worker_guard [-m] TARGET
    ARGS``, a ``--no-python`` executable ``X ARGS`` becomes ``python -u -m
    launch.worker_guard --exec X ARGS``, and a ``--run-path`` script runs like a script.
    """
    args = list(cmd_args)
    python = os.getenv("PYTHON_EXEC", sys.executable)
    if not isinstance(cmd, str):  # --run-path: torch's run_script_path(script, *args)
        return python, ["-u", "-m", GUARD_MODULE, *args]
    if cmd == python:
        if args[:1] == ["-u"]:
            args = args[1:]
        return python, ["-u", "-m", GUARD_MODULE, *args]
    return python, ["-u", "-m", GUARD_MODULE, "--exec", cmd, *args]


def worker_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment minus what only the agent may know (etcd access)."""
    return {k: v for k, v in environ.items() if k not in _AGENT_ONLY}


def _log_config(rows: Mapping[str, Any]) -> None:
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


def _worker_env(args: argparse.Namespace) -> dict[str, str]:
    values = {
        env.INPLACE_BUILD_TIMEOUT: str(args.inplace_build_timeout),
        env.HANG_TIMEOUT: str(args.hang_timeout),
        env.HANG_FACTOR: str(args.hang_factor),
        # No TORCH_NCCL_ASYNC_ERROR_HANDLING here: the worker sets it per mode when it builds
        # NCCL groups (elastic.inplace.groups: 0 when it may reconfigure in place, torch's
        # default of 3 in --elastic-mode restart).
    }
    if args.events_dir:
        values[env.EVENTS_DIR] = args.events_dir
    return values


#: Variables that make gloo and NCCL use one interface instead of picking their own.
SOCKET_IFNAME_VARS: Final = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_env(addr: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Tells the workers' gloo and NCCL to use the interface of the registered address.

    gloo otherwise binds the address this host's name resolves to (on a multi-homed host,
    in a container or a network namespace often not the one the peers reach, or none: then
    it falls back to loopback and ranks on other hosts never connect), and NCCL picks by its
    own rules; every connection a peer dials must go to the address this node registered. A
    value the user set is kept.
    """
    from membership.address import interface_of

    missing = [name for name in SOCKET_IFNAME_VARS if not environ.get(name)]
    if not missing:
        return {}
    ifname = interface_of(addr)
    if ifname is None:
        logger.warning("no local interface holds this node's address %s: gloo and NCCL pick "
                       "their own (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if peers "
                       "cannot connect)", addr)
        return {}
    return {name: ifname for name in missing}


def run(args: argparse.Namespace) -> int:
    """Runs the node agent described by validated ``args``; returns the exit code."""
    from torch.distributed.run import config_from_args

    from checkpointing.memory_store import MemoryStore
    from launch.etcd_probe import probe
    from launch.node_agent import NodeAgent
    from launch.slots import WorkerCommand
    from launch.telemetry import NodeTelemetry
    from membership.address import interface_of, registered_address
    from membership.config import RdzvConf, client_for

    config, cmd, cmd_args = config_from_args(args)
    conf = RdzvConf.parse(config.rdzv_configs, member_ttl=args.inplace_ttl)
    try:
        probe(args.rdzv_endpoint, timedelta(seconds=args.etcd_connect_timeout),
              config.rdzv_configs)
    except EtcdUnavailableError as exc:
        return _fail(str(exc), EXIT_RENDEZVOUS)
    client = client_for(args.rdzv_endpoint, conf)
    # The client holds the password now; the workers never get it (they do not talk to etcd).
    if os.environ.pop(env.ETCD_PASSWORD, None) is not None:
        logger.info("%s is not passed on to the workers.", env.ETCD_PASSWORD)
    addr = registered_address(config.local_addr or args.local_addr, args.rdzv_endpoint)
    entrypoint, worker_args = guarded_command(cmd, cmd_args)
    command = WorkerCommand((entrypoint, *worker_args), worker_base_env(os.environ))
    events = EventLog(args.events_dir, job=config.run_id, source="agent")
    if args.events_copy:
        # Synchronous and local: the ground truth a remote log (whose puts lag by up to a
        # second) is checked against.
        events.add_sink(FileSink(args.events_copy, job=config.run_id, source="agent"))
    # The workers report to this agent over a local socket; with --metrics-port the node's
    # Prometheus series are one more sink of its event log.
    telemetry = NodeTelemetry(events, metrics_port=args.metrics_port,
                              metrics_host=args.metrics_host).start()
    # Copies of the workers' committed checkpoints (theirs and a peer node's) in this
    # process's memory, which a restart loads instead of storage (checkpointing/memory_tier.py).
    memory = (MemoryStore(addr) if getattr(args, "memory_checkpoints", "on") == "on"
              else None)
    agent_config = _agent_config(args, config, conf, addr, telemetry, memory)
    _log_config({
        "script": args.training_script,
        "nodes (min:max)": f"{agent_config.min_nodes}:{agent_config.max_nodes}",
        "nproc_per_node": agent_config.nproc_per_node,
        "job id": agent_config.job_id,
        "etcd": args.rdzv_endpoint,
        "address": addr,
        "interface": interface_of(addr) or "(not local)",
        "elastic mode": agent_config.mode,
        "warm standby": getattr(args, "warm_standby", "auto"),
        "memory checkpoints": memory.address if memory is not None else "off",
        "crash budget": f"{args.max_restarts} per {args.restart_window:g} s",
        "node lease ttl": f"{agent_config.ttl} s",
        "worker command": " ".join([entrypoint, *worker_args]),
    })
    agent = NodeAgent(agent_config, client, command, events)
    agent.launched_at = process_started_at()
    monitor = _watch_signals_and_notices(args, agent)
    try:
        code, message = _run_agent(agent, events)
    finally:
        monitor.stop()
        telemetry.close()
        if memory is not None:
            memory.close()
        events.close()  # a log on a URL puts its last records (a bounded wait)
        if args.events_dir:
            from launch.goodput import write_summary

            write_summary(args.events_dir, config.run_id)  # never raises
        client.close()
    # Last, after everything that logs: the user's last line says how the job ended.
    if code != 0:
        return _fail(message, code)
    logger.info("%s", message)
    return 0


def _run_agent(agent: Any, events: EventLog) -> tuple[int, str]:
    """Runs the agent to its end; returns its exit code and its one sentence."""
    outcome, code, message = "failed", 1, "the node agent stopped unexpectedly."
    try:
        result = agent.run()
        outcome, code, message = result.outcome, result.code, result.message
    except (EtcdUnavailableError, ConfigError, RecordError) as exc:
        outcome, code, message = "rendezvous_error", EXIT_RENDEZVOUS, str(exc)
    finally:
        events.record("agent_exited", outcome=outcome, exit_code=code)
    return code, message


def _shutdown_timeout(config: Any) -> float:
    """torchrun's ``--shutdown-timeout`` (torch 2.13 added it to ``LaunchConfig``), else 30 s."""
    return float(getattr(config, "shutdown_timeout", None) or 30)


def _agent_config(args: argparse.Namespace, config: Any, conf: Any, addr: str,
                  telemetry: Any, memory: Any = None) -> Any:
    """The node agent's settings, from torchrun's parsed config, ``--rdzv-conf`` and ours."""
    from launch.agent_config import AgentConfig
    from launch.budget import CrashBudget

    return AgentConfig(
        job_id=config.run_id, key_prefix=conf.key_prefix, min_nodes=config.min_nodes,
        max_nodes=config.max_nodes, nproc_per_node=int(config.nproc_per_node), addr=addr,
        ttl=conf.member_ttl, last_call=conf.last_call_timeout,
        join_timeout=conf.join_timeout, monitor_interval=config.monitor_interval,
        budget=CrashBudget(max_restarts=args.max_restarts, window=args.restart_window),
        mode=args.elastic_mode, shutdown_grace=_shutdown_timeout(config),
        drain_timeout=args.preemption_drain_timeout, linger=conf.linger,
        worker_env={**_worker_env(args), **interface_env(addr, os.environ),
                    **telemetry.worker_env,
                    **({env.MEMORY_STORE: memory.address} if memory is not None else {})},
        metrics_port=telemetry.metrics_port, build_timeout=args.inplace_build_timeout,
        warm_standby=getattr(args, "warm_standby", "auto") != "off",
        standby_in_place=getattr(args, "warm_standby", "auto") == "on",
    )


def _watch_signals_and_notices(args: argparse.Namespace, agent: Any) -> Any:
    """Starts the preemption watchers and routes SIGTERM/SIGINT to the agent; returns the
    monitor to stop."""
    from launch.preemption import PreemptionMonitor

    watchers = _watchers(args)
    agent.preemption_watch = [w.source for w in watchers]
    monitor = PreemptionMonitor(watchers)
    monitor.start(agent.request_departure)  # main thread: the SIGTERM watcher needs it
    if "sigterm" not in agent.preemption_watch:
        signal.signal(signal.SIGTERM, lambda signum, _frame: agent.request_stop(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: agent.request_stop(signum))
    return monitor
