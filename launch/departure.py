"""A planned departure: what a node does between a preemption notice and the machine's end.

The agent (:class:`launch.agent.NodeAgent`) runs the steps in its main thread:

1. announce the departure in etcd (the member key gets a ``departing`` note), so the peers
   whose workers stop next know it is planned, not a failure;
2. send SIGTERM to its workers, whose ``ElasticLoop`` agrees with every rank to stop at the next
   step boundary and writes a final checkpoint; wait for them up to the drain budget
   (:func:`drain_budget`), then SIGKILL what is left;
3. leave the rendezvous without closing it (torch's exit operation, member lease revoked), so
   the survivors form the next round at once;
4. exit 0 (:class:`PlannedDeparture` carries the notice to the runner).

A :class:`DepartureWatchdog` bounds the whole sequence: if the main thread is stuck (for
example in a rendezvous round that is still forming), the watchdog leaves and ends the process
before the deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Final

from launch.preemption import PreemptionNotice

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT: Final = timedelta(seconds=60)
DEFAULT_LEAVE_RESERVE: Final = timedelta(seconds=5)
_POLL_S: Final = 0.05
_KILL_WAIT_S: Final = 5


class PlannedDeparture(Exception):  # an outcome, not an error; named for what happened
    """The node left the job on a preemption notice (the launcher exits 0).

    Attributes:
        notice: The notice that started the departure.
        drained: Whether the workers stopped by themselves within the drain budget.
    """

    def __init__(self, notice: PreemptionNotice, *, drained: bool) -> None:
        super().__init__(f"planned departure on a {notice.source} notice")
        self.notice = notice
        self.drained = drained


def drain_budget(
    notice: PreemptionNotice, *, drain_timeout: timedelta = DEFAULT_DRAIN_TIMEOUT,
    leave_reserve: timedelta = DEFAULT_LEAVE_RESERVE, now: Any = None,
) -> float:
    """Seconds the workers may take to stop and checkpoint before they are killed.

    ``drain_timeout``, shortened so that ``leave_reserve`` is left before the notice's
    deadline; 0 when the deadline leaves no time (the workers are killed at once).
    """
    budget = drain_timeout.total_seconds()
    left = notice.time_left(now)
    if left is not None:
        budget = min(budget, (left - leave_reserve).total_seconds())
    return max(0.0, budget)


def drain_workers(pcontext: Any, budget_s: float) -> tuple[dict[int, int | None], bool]:
    """SIGTERM each worker process, wait up to ``budget_s`` for all to exit, SIGKILL the rest.

    Only the workers' own processes get SIGTERM, not their process groups: a DataLoader
    worker killed under a draining trainer would fail the final checkpoint.

    Args:
        pcontext: torch's process context of the workers (``None``: nothing to drain).
        budget_s: Seconds to wait before killing.

    Returns:
        (exit code by local rank, None if unknown; whether all stopped within the budget).
    """
    if pcontext is None:
        return {}, True
    for pid in pcontext.pids().values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    handlers: Mapping[int, Any] | None = getattr(pcontext, "subprocess_handlers", None)
    end = time.monotonic() + budget_s
    if handlers is None:  # function entrypoints (multiprocessing): torch's own wait
        result = pcontext.wait(budget_s, period=_POLL_S)
        drained = result is not None
        codes: dict[int, int | None] = {}
        if result is not None:
            codes = {lr: f.exitcode for lr, f in result.failures.items()}
    else:
        while time.monotonic() < end and any(h.proc.poll() is None for h in handlers.values()):
            time.sleep(_POLL_S)
        drained = all(h.proc.poll() is not None for h in handlers.values())
        codes = {lr: h.proc.returncode for lr, h in handlers.items()}
    if not drained:
        logger.warning("Workers did not stop within the drain budget (%.1f s); killing them.",
                       budget_s)
        pcontext.close(signal.SIGKILL, _KILL_WAIT_S)
        if handlers is not None:
            codes = {lr: h.proc.returncode for lr, h in handlers.items()}
    return codes, drained


class DepartureWatchdog:
    """Calls ``on_expire`` after ``after`` unless cancelled first (a daemon thread).

    Args:
        after: How long the orderly departure may take.
        on_expire: The emergency exit (it is expected not to return).
    """

    def __init__(self, after: timedelta, on_expire: Callable[[], None]) -> None:
        self._after_s = max(0.0, after.total_seconds())
        self._on_expire = on_expire
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="departure-watchdog",
                                        daemon=True)

    def start(self) -> None:
        """Starts the countdown."""
        self._thread.start()

    def cancel(self) -> None:
        """Stops the countdown (the orderly departure finished)."""
        self._cancelled.set()

    def _run(self) -> None:
        if self._cancelled.wait(self._after_s):
            return
        logger.error("The planned departure did not finish within %.1f s; leaving now.",
                     self._after_s)
        self._on_expire()
