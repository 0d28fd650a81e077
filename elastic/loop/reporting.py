"""What the loop reports: its events (the job's event log, the node's metrics), the opt-in
per-sample audit, and messages to the node agent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic.batching import BatchPlan
from elastic.contract.messages import WorkerMessage
from elastic.eventlog import EventLog
from elastic.loop.audit import SampleAudit

if TYPE_CHECKING:
    from elastic.context import ElasticContext

__all__ = ["LoopReporting", "tell_agent"]


class LoopReporting:
    """The events and the sample audit of :class:`~elastic.loop.ElasticLoop`."""

    ctx: ElasticContext | None
    plan: BatchPlan
    storage_loads: int
    _events: EventLog
    _audit: SampleAudit | None
    _inplace: Any

    if TYPE_CHECKING:
        def _rank(self) -> int: ...

    def _record(self, event: str, **fields: Any) -> None:
        """Records an event: every rank's reaches its agent's metrics; the job's log keeps
        global rank 0's (durable): one copy per step (the steps are collective)."""
        self._events.record(event, durable=self.ctx is None or self.ctx.rank == 0, **fields)

    def _generation(self) -> int:
        return self.ctx.generation if self.ctx is not None else 0

    def _audit_world(self, step: int) -> None:
        if self._audit is None:
            return
        heal = getattr(self._inplace, "last_heal", None) if self._inplace else None
        self._audit.world(generation=self._generation(), rank=self._rank(),
                          world=self.plan.world_size, step=step,
                          storage_loads=self.storage_loads,
                          received=bool(heal and heal.received),
                          source=heal.source if heal else -1)


def tell_agent(message: WorkerMessage) -> None:
    """Sends a message to the node agent when elastic-run runs this worker (else nothing)."""
    from elastic.agent_link import current_link

    link = current_link()
    if link is not None:
        link.send(message)
