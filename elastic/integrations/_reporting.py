"""What a framework-driven worker tells its node agent: the events of the job log and the
node's metrics, and the messages of the agent's channel.

The records are ``ElasticLoop``'s (:mod:`elastic.eventlog`), so ``elastic-run goodput`` and
``--metrics-port`` cover these jobs the same way: ``step`` (its compute time, excluding
checkpoint stalls), ``checkpoint`` (the time training was blocked by a save),
``checkpoint_committed``, ``checkpoint_failed`` and ``restored``. Every rank records them; the
job log keeps global rank 0's, the node's metrics its local rank 0's. Over the channel the
worker says how far it got (``progress``, at most twice a second: the agent tells a node cut
off from the job from a job-wide etcd outage by it) and that it drained (a stop that is not a
failure). A worker that dies of an exception is reported by ``launch.worker_guard``, with the
step this reporter last saw.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from elastic.agent_link import AgentLink, current_link, link_from_env
from elastic.contract.messages import Drained, Progress, WorkerMessage
from elastic.eventlog import EventLog
from elastic.integrations._world import WorkerWorld

__all__ = ["Reporter"]

logger = logging.getLogger(__name__)

#: The agent hears of a completed step at most this often.
PROGRESS_EVERY_S: Final = 0.5


class Reporter:
    """Events and agent messages of one worker.

    Args:
        world: This worker's world.
    """

    def __init__(self, world: WorkerWorld) -> None:
        self.world = world
        self.events = EventLog.from_env()
        self._progress_told = 0.0
        link = current_link()
        if link is None:
            try:
                link = link_from_env()  # the heartbeat also lets the agent see a frozen worker
            except (ConnectionError, ValueError) as exc:
                logger.warning("cannot reach the node agent (%s); training on without it", exc)
        self.link: AgentLink | None = link

    def _record(self, event: str, **fields: Any) -> None:
        self.events.record(event, round=self.world.round, durable=self.world.rank == 0,
                           **fields)

    def tell(self, message: WorkerMessage) -> None:
        """Sends a message to the node agent (nothing without one)."""
        if self.link is not None:
            self.link.send(message)

    def step(self, index: int, duration_s: float) -> None:
        """Step ``index`` (0-based) completed after ``duration_s`` of compute."""
        if self.link is not None:
            self.link.step = index + 1
            now = time.monotonic()
            if now - self._progress_told >= PROGRESS_EVERY_S:
                self._progress_told = now
                self.tell(Progress(index + 1))
        self._record("step", step=index, duration_s=round(max(0.0, duration_s), 4),
                     world=self.world.world_size)

    def checkpoint(self, step: int, blocked_s: float, *, final: bool) -> None:
        """A save of ``step`` blocked training for ``blocked_s``."""
        self._record("checkpoint", step=step, blocked_s=round(blocked_s, 4), final=final)

    def committed(self, step: int, durable_s: float) -> None:
        """The checkpoint of ``step`` is committed, ``durable_s`` after its save began."""
        self._record("checkpoint_committed", step=step, durable_s=round(durable_s, 4),
                     world=self.world.world_size)

    def checkpoint_failed(self, step: int, error: BaseException) -> None:
        """The save of ``step`` failed: the previous checkpoint stays the newest."""
        self._record("checkpoint_failed", step=step, error=f"{type(error).__name__}: {error}")

    def restored(self, step: int, *, found: bool, duration_s: float) -> None:
        """Training resumes at ``step`` (``found``: from a checkpoint)."""
        self._record("restored", step=step, found=found, duration_s=round(duration_s, 4))

    def drained(self, step: int) -> None:
        """Stopped at ``step`` after a final checkpoint: a planned stop, not a failure."""
        logger.info("drained at step %d", step)
        self.tell(Drained(step))
        self.flush()

    def flush(self) -> None:
        """Sends the records still waiting to be coalesced (never waits)."""
        self.events.flush(0.0)
