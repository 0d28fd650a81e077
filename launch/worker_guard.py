"""Worker bootstrap that ties a worker's life to its node agent's.

torch's agent starts each worker in a session of its own (``start_new_session=True``), so a
worker outlives an agent that is SIGKILLed or OOM-killed and trains on invisibly. The agent
therefore starts every worker as::

    python -u -m launch.worker_guard [-m | --exec] TARGET [ARGS...]

which asks the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``,
kept across ``execve``), checks that the parent is still the agent (closing the race where the
agent died before the request was made), and then runs ``TARGET`` exactly as ``python TARGET``,
``python -m TARGET`` or ``exec TARGET`` would. Where ``prctl`` is missing (not Linux) a daemon
thread polls the parent pid instead.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import runpy
import signal
import sys
import threading
import time
from typing import Final, NoReturn

from elastic import env

_PR_SET_PDEATHSIG: Final = 1
_POLL_INTERVAL_S: Final = 0.5
USAGE: Final = "usage: python -m launch.worker_guard [-m | --exec] TARGET [ARGS...]"


def _set_parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits.

    Returns:
        ``True`` if the request was accepted, ``False`` where ``prctl`` is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError:
        return False
    return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def _expected_parent() -> int | None:
    raw = os.environ.get(env.AGENT_PID, "")
    return int(raw) if raw.isdigit() else None


def _poll_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(_POLL_INTERVAL_S)


def guard(parent: int | None = None) -> None:
    """Make this process die with ``parent`` (default: the agent named in the environment).

    Args:
        parent: pid of the agent; ``None`` reads ``ELASTIC_AGENT_PID`` and falls back to the
            current parent process.
    """
    if parent is None:
        parent = _expected_parent() or os.getppid()
    armed = _set_parent_death_signal(signal.SIGKILL)
    # The agent may have died between fork and prctl: the signal would then never come.
    if os.getppid() != parent:
        sys.stderr.write(
            f"worker_guard: the agent (pid {parent}) is already gone; exiting instead of "
            "training without it.\n"
        )
        os._exit(1)
    if not armed:
        threading.Thread(
            target=_poll_parent, args=(parent,), name="elastic-worker-guard", daemon=True
        ).start()


def parse_target(args: list[str]) -> tuple[str, str, list[str]] | None:
    """``[-m | --exec] TARGET ARGS...`` as ``(mode, target, args)``; ``None`` without a
    target. ``mode`` is ``path``, ``module`` or ``exec``."""
    mode = "path"
    if args and args[0] in ("-m", "--exec"):
        mode = "module" if args[0] == "-m" else "exec"
        args = args[1:]
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        return None
    return mode, args[0], list(args[1:])


def main(argv: list[str] | None = None) -> int:
    """Guard this process, then run the target. Returns only on a usage error."""
    parsed = parse_target(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        sys.stderr.write(USAGE + "\n")
        return 2
    guard()
    return run_target(*parsed)


def run_target(mode: str, target: str, rest: list[str]) -> int:
    """Runs ``target`` in this process as ``python TARGET``, ``python -m TARGET`` or ``exec
    TARGET`` would (a script's uncaught exception is reported to the agent, then ends the
    process with exit code 1); returns 0 when the target returns.

    Also the last thing a warm standby (:mod:`launch.standby`) does once handed a world.
    """
    if mode == "exec":
        os.execvp(target, [target, *rest])
    sys.argv = [target, *rest]
    try:
        if mode == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # ``python script.py`` puts the script's directory, not the cwd, first on sys.path.
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        _report(exc)
        _die(exc)
    return 0


def _die(exc: BaseException) -> NoReturn:
    """Ends a worker that raised: the traceback as the interpreter prints it, the exit
    handlers (event and telemetry flushes), then exit code 1 at once.

    The interpreter's own teardown of a torch process (module finalisation, seconds on a busy
    host) is skipped: its heartbeat thread is already gone then, and an agent that hears
    nothing for the lease TTL takes the worker for a hung one and kills it, losing the
    error the worker just reported.
    """
    sys.excepthook(type(exc), exc, exc.__traceback__)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


def _report(exc: BaseException) -> None:
    """Tells the node agent why the script failed (its error ends the job's output)."""
    if not os.environ.get(env.AGENT_SOCKET):
        return
    from elastic.agent_link import report_failure

    report_failure(exc)


if __name__ == "__main__":
    sys.exit(main())
