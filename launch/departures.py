"""Leaving the job on purpose: a preemption notice, or a stop signal.

One part of the node agent (``docs/agent.md`` has the map). Notices come from the watchers of
:mod:`launch.preemption` and signals from the runner, on any thread; both only set a flag
here, and the agent's main loop carries the departure out:

* **A preemption notice.** The node announces it is departing (a note in its record). In place
  the leader writes a world without it at once, marked *departed*: its workers leave at the
  next step boundary, and the survivors go on without restarting or reading storage. In
  restart mode the world stays until the workers drained (a final checkpoint needs every
  rank), then goes as planned. Either way the node leaves once its workers exited, or when
  the drain timeout (or the notice's own deadline) runs out.
* **SIGTERM or SIGINT.** The workers get SIGTERM and drain at the next step boundary; the node
  leaves once they exited, or after the shutdown grace, with ``128 + signal`` (as torchrun).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from elastic.eventlog import EventLog
from launch.agent_config import AgentConfig, AgentOutcome
from launch.slots import stop_all
from launch.supervisor import Supervisor

__all__ = ["Departures"]

logger = logging.getLogger(__name__)


class Departures:
    """A node's planned departure or stop, requested from any thread.

    Args:
        config: The agent's settings (drain timeout, shutdown grace).
        supervisor: The slots whose workers leave.
        events: The job event log.
        wake: Wakes the agent's main loop.
    """

    def __init__(self, config: AgentConfig, supervisor: Supervisor, events: EventLog, *,
                 wake: Callable[[], None]) -> None:
        self.config = config
        self._supervisor = supervisor
        self.events = events
        self._wake = wake
        self.notice: Any = None
        self._since: float | None = None
        self.signal: int | None = None
        self._stop_since: float | None = None

    @property
    def leaving(self) -> bool:
        """Whether the node leaves (no new worker may start)."""
        return self.notice is not None or self.signal is not None

    def request_departure(self, notice: Any) -> None:
        """Leave the job on ``notice`` (any thread; the main loop does the work, once)."""
        if self.notice is None:
            self.notice = notice
            self._wake()

    def request_stop(self, signum: int) -> None:
        """Stop on a signal (signal-safe: it only sets a flag the main loop acts on)."""
        if self.signal is None:
            self.signal = signum
            self._wake()

    def note(self) -> dict[str, Any] | None:
        """The ``departing`` note of the node record (``None`` while not departing)."""
        notice = self.notice
        if notice is None:
            return None
        deadline = getattr(notice, "deadline", None)
        return {"source": getattr(notice, "source", "notice"),
                "deadline": deadline.isoformat() if deadline is not None else None}

    def depart_if_noticed(self, in_place: bool, epoch: int,
                          publish: Callable[[], None]) -> AgentOutcome | None:
        """Runs a planned departure: announce, let the workers leave, then go.

        Args:
            in_place: The node's world reconfigures in place.
            epoch: The node's world epoch (for the event log).
            publish: Writes the node record (with the departing note).
        """
        notice = self.notice
        if notice is None:
            return None
        now = time.monotonic()
        source = getattr(notice, "source", "?")
        if self._since is None:
            self._since = now
            logger.warning("preemption notice from %s: leaving the job", source)
            self.events.record("planned_departure", round=epoch, notice=source,
                               in_place=in_place, announced=True, member_ttl=self.config.ttl,
                               deadline=(self.note() or {}).get("deadline"))
            publish()
            if not in_place:
                self._supervisor.terminate_all()
        budget = min(self.config.drain_timeout, _notice_budget(notice))
        running = self._supervisor.running()
        if running and now - self._since < budget:
            return None
        if running:
            stop_all(running, 0.0)
        self.events.record("left_rendezvous", round=epoch, drained=not running,
                           drain_s=round(now - self._since, 3))
        return AgentOutcome(0, "departed", f"left the job on a "
                            f"{getattr(notice, 'source', 'preemption')} notice.")

    def stop_if_signalled(self) -> AgentOutcome | None:
        """Passes a stop signal on to the workers, waits for them (up to the shutdown grace),
        then ends this node's part with ``128 + signal``."""
        signum = self.signal
        if signum is None:
            return None
        now = time.monotonic()
        if self._stop_since is None:
            self._stop_since = now
            logger.warning("signal %d: stopping this node's workers (they drain at the next "
                           "step boundary) and leaving the job", signum)
            running = self._supervisor.terminate_all()
        else:
            running = self._supervisor.running()
        if running and now - self._stop_since < self.config.shutdown_grace:
            return None
        if running:
            stop_all(running, 0.0)
        return AgentOutcome(128 + signum, "signal",
                            f"stopped by signal {signum} (workers "
                            f"{'killed' if running else 'drained'}).")


def _notice_budget(notice: Any) -> float:
    """Seconds left before the notice's deadline (a few kept to leave), or no limit."""
    left = getattr(notice, "time_left", None)
    remaining = left() if callable(left) else None
    if isinstance(remaining, timedelta):
        return max(0.0, remaining.total_seconds() - 5.0)
    return float("inf")
