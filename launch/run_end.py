"""How a node's part of the job ends with the run: the run's end record decides."""

from __future__ import annotations

import time
from typing import Final

from elastic.contract.records import EndRecord
from elastic.eventlog import EventLog
from launch.agent_config import AgentOutcome
from launch.slots import stop_all
from launch.supervisor import Supervisor

__all__ = ["came_late", "finish"]

#: How long workers of a finished run get to exit on their own (a final checkpoint).
FINISH_GRACE_S: Final = 30.0


def came_late(job_id: str, end: EndRecord) -> AgentOutcome:
    """A node that came after the run ended (within ``linger``): nothing to do."""
    if end.outcome == "finished":
        return AgentOutcome(0, "already_finished",
                            f"job {job_id} already finished ({end.reason}); this node has "
                            "nothing to do.")
    return AgentOutcome(1, "failed", f"job {job_id} failed: {end.reason}")


def finish(end: EndRecord, supervisor: Supervisor, events: EventLog, job_id: str,
           epoch: int) -> AgentOutcome:
    """The run ended: let finishing workers exit, stop the rest, report the outcome (the
    run's reason is the node's last line)."""
    deadline = time.monotonic() + (FINISH_GRACE_S if end.outcome == "finished" else 0.0)
    while time.monotonic() < deadline and supervisor.running():
        time.sleep(0.05)
    with supervisor.lock:
        processes = [s.process for s in supervisor.slots if s.process is not None]
    stop_all(processes, 0.0 if end.outcome == "failed" else 5.0)
    if end.outcome == "finished":
        events.record("job_finished", round=epoch)
        return AgentOutcome(0, "succeeded", f"job {job_id} finished.")
    return AgentOutcome(1, "failed", f"job {job_id} failed: {end.reason}")
