"""What the node agent knows about each worker slot (shared by its parts, owned by
:class:`~launch.supervisor.Supervisor`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic.contract.records import WorkerSlot, WorldRecord
from launch.slots import SlotProcess

__all__ = ["PendingFailure", "Slot"]


@dataclass
class PendingFailure:
    """A worker's failure whose cause is not settled yet: a peer's, or its own
    (:class:`~launch.failure_judge.FailureJudge` decides).

    Attributes:
        process: The worker that failed.
        code: Its exit code.
        world: The world it trained in.
        decide_by: ``time.monotonic()`` by which evidence of a peer's failure must come.
        lease_fresh: Whether this node's lease was fresh when it failed.
        probed: Whether its world's other nodes were probed already.
        peer_node_dead: Another node of its world was found dead (its liveness port refused).
        peers_answered_at: When every other node of its world answered a probe (``None``:
            not yet, or not all).
    """

    process: SlotProcess
    code: int
    world: WorldRecord | None
    decide_by: float
    lease_fresh: bool = True
    probed: bool = False
    peer_node_dead: bool = False
    peers_answered_at: float | None = None


@dataclass
class Slot:
    """The agent's view of one worker slot.

    Attributes:
        local_rank: The slot.
        incarnation: Which start of the slot the current (or next) process is.
        process: The running process, if any.
        ready: The slot may be placed in a world (published in the node record).
        inplace: Its worker reconfigures in place.
        restart_at: ``time.monotonic()`` when a crashed worker restarts (its backoff).
        started_for: The world its process was started for (restart mode).
        report: What its process said it died of (or that it drained).
        connected: Its process said hello on the channel (it reached ``elastic.init()``).
        connected_at: ``time.monotonic()`` of that hello (``None``: not yet).
        step: The last step its process completed.
        waiting: ``{"epoch", "step"}`` while its process waits past the hang threshold.
        finished: Its process exited 0.
        pending: A failure being judged.
    """

    local_rank: int
    incarnation: int = 0
    process: SlotProcess | None = None
    ready: bool = False
    inplace: bool = False
    restart_at: float | None = None
    started_for: WorldRecord | None = None
    report: dict[str, Any] | None = None
    connected: bool = False
    connected_at: float | None = None
    step: int = -1
    waiting: dict[str, Any] | None = None
    finished: bool = False
    pending: PendingFailure | None = None

    def published(self) -> WorkerSlot:
        """The slot as its node record shows it."""
        pid = self.process.pid if self.process is not None else 0
        return WorkerSlot(self.local_rank, self.incarnation, self.ready, self.inplace, pid,
                          finished=self.finished)

    @property
    def local_id(self) -> str:
        """``{local_rank}.{incarnation}``."""
        return f"{self.local_rank}.{self.incarnation}"

    def next_incarnation(self) -> None:
        """Makes the slot ready for its next process (nothing of the last one carries)."""
        self.incarnation += 1
        self.ready = False
        self.inplace = False
        self.report = None
        self.connected = False
        self.connected_at = None
        self.waiting = None
        self.started_for = None
