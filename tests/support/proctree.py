"""Process trees from ``/proc``: find a process's descendants, signal or kill them by PID.

Everything here relies on the parent links in ``/proc/<pid>/stat`` only, never on process
names (except :func:`workers`, which leaves out an agent's waiting warm standbys), so it keeps
working whatever program an agent or a worker is. A process whose parent died is re-parented
(to PID 1 or a subreaper) and leaves its old tree: callers that must find every process of a
host use the network-namespace scan of :mod:`tests.support.netns_names` as well.

Example::

    pids = workers(agent.pid)              # an agent's workers, in start order
    sigstop(pids[0])                       # hang it (its sockets stay open)
    sigcont(pids[0])
    kill_tree(agent.pid)                   # the agent and everything below it
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterable

#: How often :func:`wait_gone` looks again, in seconds.
_POLL_S = 0.02


def _stat_fields(pid: int) -> list[str] | None:
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T`` when stopped, ...), or ``None``."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _start_time(fields: list[str]) -> int:
    return int(fields[19])  # field 22 of stat, counted after the command name


def _parents() -> dict[int, tuple[int, int]]:
    """``pid -> (ppid, start time)`` of every live, non-zombie process."""
    out: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None and fields[0] != "Z":
                out[int(entry)] = (int(fields[1]), _start_time(fields))
    return out


def children(pid: int) -> list[int]:
    """The live direct children of ``pid``, oldest first (an agent's workers, say).

    Unlike ``/proc/<pid>/task/<pid>/children`` this also finds children that threads other
    than the main one started.
    """
    table = _parents()
    return sorted((c for c, (p, _) in table.items() if p == pid), key=lambda c: table[c][1])


#: The agent's line for each worker it starts, cold or in a warm standby (launch/slots.py).
_STARTED_WORKER = re.compile(r"started worker \d+\.\d+ \(pid (\d+)[,)]")


def workers(pid: int, log: str | None = None) -> list[int]:
    """:func:`children` of an agent that are workers, oldest first: without its warm standbys
    that no world was handed to yet (:mod:`launch.standby`).

    Args:
        pid: The agent.
        log: The agent's output so far. With it, exactly the children it names as started
            workers; without it, the children but those whose ``comm`` name says standby,
            which misses two moments: a standby's first tenth of a second (before it names
            itself) looks like a worker, and a world handed to a standby still importing
            looks like a standby until its imports end.
    """
    if log is not None:
        named = {int(found) for found in _STARTED_WORKER.findall(log)}
        return [c for c in children(pid) if c in named]
    from launch.standby import is_standby

    return [c for c in children(pid) if not is_standby(c)]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first, then theirs), without ``pid``."""
    table = _parents()
    by_parent: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        by_parent.setdefault(parent, []).append(child)
    out: list[int] = []
    frontier = [pid]
    while frontier:
        level = sorted((c for p in frontier for c in by_parent.get(p, ())),
                       key=lambda c: table[c][1])
        out.extend(level)
        frontier = level
    return out


def tree(pid: int) -> list[int]:
    """``pid`` (if alive) followed by :func:`descendants`."""
    return ([pid] if alive(pid) else []) + descendants(pid)


def signal_pids(pids: Iterable[int], sig: signal.Signals) -> None:
    """Sends ``sig`` to each of ``pids``, ignoring those that are already gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_stopped(pids: list[int], stopped: bool, timeout_s: float) -> None:
    # Signals are delivered when the target is next scheduled: wait until they took effect.
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pids if alive(p) and (state(p) == "T") != stopped]
        if not pending:
            return
        if time.monotonic() >= deadline:
            verb = "stop" if stopped else "continue"
            raise TimeoutError(f"processes {pending} did not {verb} within {timeout_s:g} s.")
        time.sleep(_POLL_S / 4)


def sigstop(pid: int, *, whole_tree: bool = False, timeout_s: float = 5.0) -> list[int]:
    """SIGSTOPs ``pid`` (a hung process: its sockets stay open, it answers nothing).

    Returns once every process is stopped.

    Args:
        pid: the process.
        whole_tree: stop its descendants too, parents before children so that no parent
            sees a child stop and reacts.
        timeout_s: how long to wait for the processes to stop.

    Returns:
        The PIDs stopped, to pass to :func:`sigcont`.

    Raises:
        TimeoutError: when a process is not stopped within ``timeout_s``.
    """
    pids = tree(pid) if whole_tree else [pid]
    signal_pids(pids, signal.SIGSTOP)
    _wait_stopped(pids, True, timeout_s)
    return pids


def sigcont(pid: int | Iterable[int], *, timeout_s: float = 5.0) -> None:
    """SIGCONTs ``pid`` (or every PID :func:`sigstop` returned, children first).

    Returns once none of them is stopped any more.
    """
    pids = [pid] if isinstance(pid, int) else list(pid)
    signal_pids(reversed(pids), signal.SIGCONT)
    _wait_stopped(pids, False, timeout_s)


def kill_tree(pid: int, sig: signal.Signals = signal.SIGKILL) -> list[int]:
    """Sends ``sig`` (SIGKILL by default) to ``pid`` and every descendant.

    The tree is read before the first signal, so children re-parented by their parent's death
    are still hit. Returns the PIDs signalled.
    """
    pids = tree(pid)
    signal_pids(pids, sig)
    return pids


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Waits until none of ``pids`` is alive; returns those still alive after ``timeout_s``."""
    pending = list(pids)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [p for p in pending if alive(p)]
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(_POLL_S)
