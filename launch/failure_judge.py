"""Judging a worker's failure: whose fault it was, and what it costs the node's crash budget.

One part of the node agent (``docs/agent.md`` has the map). The crash budget
(:class:`~launch.budget.CrashBudget`) is charged here and nowhere else:

* a worker that died of a peer's failure is never charged. Membership decides that, never an
  error's text: a newer world names a worker of another node of its world as lost or
  evicted, another node of its world refuses a liveness probe, or the worker said so;
* a worker that failed while this node's lease was not fresh lost its peers to a partition
  (the others moved on without this node): not charged either;
* a worker the agent stopped, or that drained, is not a failure;
* anything else is a crash: charged, and restarted after the budget's backoff. A node whose
  budget is exhausted leaves the job.

Until one of those is certain the failure waits (:class:`~launch.slot_state.PendingFailure`),
at most the lease TTL + 1 s (a silent peer host takes its lease TTL to be known). It is
certain at once when the worker's world has no other node (no peer of another node could have
caused it), and one second after every other node of its world answered a liveness probe
(a peer's crash reaches this node's view of the world within that). Each failure's error (the
worker's report, or the last line of its standard error when it died before it could report,
such as an unknown flag or an ImportError) is kept for the leader's "script bug" rule
(:func:`~membership.proposal.common_failure`), which ends the job when every node's workers
died of the same error at the same step. An error of a type a dead peer causes (a collective's
``RuntimeError``) counts there as the workers' own only once every other node of their world
answers a liveness probe: a node killed whole makes its survivors die of one error text at
one step, and a world written meanwhile may name only the survivors' restarted workers as
lost (a chaos campaign and CI ended a healthy job so).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from elastic.contract.messages import Drained, Failure, Gone
from elastic.contract.records import WorldRecord, worker_id
from elastic.eventlog import EventLog
from launch.agent_config import AgentConfig, AgentOutcome
from launch.evictions import PeerEvictor
from launch.slot_state import PendingFailure, Slot
from launch.slots import SlotProcess
from launch.supervisor import Supervisor
from membership.job import RunMembership

__all__ = ["FailureJudge"]

logger = logging.getLogger(__name__)

#: After every other node of a failed worker's world answered a probe, how long a peer's
#: crash may take to show in this node's view of the world (its agent reaps it, the leader
#: writes the world): longer, and the failure is the worker's own.
PEERS_ANSWERED_SETTLE_S: Final = 1.0


class FailureJudge:
    """Decides what each failed worker costs.

    Args:
        config: The agent's settings (its crash budget, the lease TTL).
        supervisor: The slots (restarted through it).
        evictor: Probes (and removes) the failed worker's peers.
        events: The job event log.
        node: This node's id.
        run: This node's membership of the run (``None`` before it joined).
        still_connected: Whether the channel still has an open connection from a process.
        broadcast: Sends a message to this node's workers.
        wake: Wakes the agent's main loop.
        publish: Asks the agent's main loop to write this node's record (any thread).
    """

    def __init__(self, config: AgentConfig, supervisor: Supervisor, evictor: PeerEvictor,
                 events: EventLog, *, node: Callable[[], str],
                 run: Callable[[], RunMembership | None],
                 still_connected: Callable[[SlotProcess], bool],
                 broadcast: Callable[[Gone], None], wake: Callable[[], None],
                 publish: Callable[[], None]) -> None:
        self.config = config
        self.budget = config.budget
        self._supervisor = supervisor
        self._evictor = evictor
        self.events = events
        self._node = node
        self._run = run
        self._still_connected = still_connected
        self._broadcast = broadcast
        self._wake = wake
        self._publish = publish
        #: The last error this node's workers died of (published for the leader).
        self.failure_note: dict[str, Any] | None = None
        #: Crashes charged so far (published).
        self.restarts = 0
        #: The budget ran out: this node leaves the job.
        self.exhausted = False

    def reported(self, slot: Slot, message: Failure) -> None:
        """A worker said what it is dying of. A report that came before this agent stopped
        the worker is the worker's own failure, even if the stop then ended it (a restart
        racing its death)."""
        slot.report = {"error": message.error, "step": message.step, "peer": message.peer,
                       "peer_type": message.peer_type,
                       "before_stop": slot.process is not None and not slot.process.stopping}

    def drained(self, slot: Slot, message: Drained) -> bool:
        """A worker stopped at a step boundary after a final checkpoint (a peer's notice, or
        this node's): not a failure, whatever its exit code."""
        slot.report = {"drained": True, "step": message.step}
        return False

    def _newest_world(self) -> WorldRecord | None:
        run = self._run()
        return run.world() if run is not None else None

    def _lease_fresh(self) -> bool:
        """Whether etcd may still hold this node's lease: refreshed within its TTL. A worker
        whose peers moved on without this node failed later than that (etcd drops a lease a
        TTL after its last refresh, and only then do the others move on); the margin keeps a
        refresh delayed by a busy machine from passing a crash off as a partition. (The
        commit fence is stricter: half the TTL.)"""
        run = self._run()
        lease = run.node.lease if run is not None else None
        return lease is None or lease.fresh(margin=1.0)

    def restarted_while_dying(self, slot: Slot) -> None:
        """Restart mode restarted ``slot`` while its worker was dying of its own error: that
        error still counts (every worker dying of it ends the job at once)."""
        report = slot.report or {}
        if report.get("before_stop") and report.get("error"):
            self._note_failure(report, slot.started_for)
            logger.warning("worker %s failed (%s) as this node restarted its workers",
                           slot.local_id, report.get("error"))

    def failed(self, slot: Slot, process: SlotProcess, code: int,
               world: WorldRecord | None) -> None:
        """A worker exited non-zero: its failure waits for its cause (see :meth:`settle`)."""
        slot.pending = PendingFailure(process, code, world,
                                      time.monotonic() + self.config.ttl + 1.0,
                                      lease_fresh=self._lease_fresh())

    def settle(self, slot: Slot, now: float, last_world: WorldRecord | None) -> bool:
        """Decides ``slot``'s pending failure once its cause is known; False if the budget
        is exhausted (see the module docstring)."""
        failure = slot.pending
        assert failure is not None
        if now < failure.decide_by and self._still_connected(failure.process):
            # Its last messages (the report of what it died of) may still be in the channel:
            # the process is gone, so the channel's end of file follows at once.
            return True
        report = slot.report or {}
        partitioned = not (failure.lease_fresh and self._lease_fresh())
        # Its own failure, never a peer's: an error of a type no peer causes, or a signal.
        own = report.get("peer_type") is False or failure.code < 0
        alone = failure.world is not None and not self._other_nodes(failure.world)
        answered = (failure.peers_answered_at is not None
                    and now >= failure.peers_answered_at + PEERS_ANSWERED_SETTLE_S)
        certain = (failure.process.stopping or bool(report.get("peer"))
                   or bool(report.get("drained")) or partitioned or own or alone)
        if not (certain or self._peer_evidence(failure) or answered
                or now >= failure.decide_by):
            if not failure.probed:
                # A dead node's lease outlives it by up to the TTL, and the world written
                # meanwhile may name only this node's worker: ask its peers directly.
                failure.probed = True
                threading.Thread(target=self._probe_peers, args=(failure,), daemon=True,
                                 name="elastic-probe-peers").start()
            return True  # the cause is not settled yet: wait for membership to say
        slot.pending = None
        if not failure.process.stopping and not own and self._peer_evidence(failure):
            slot.report = report = {**report, "peer": True}
        elif not failure.process.stopping and partitioned:
            slot.report = report = {**report, "partition": True}
        if not report.get("error") and not slot.connected and failure.process.last_error_line:
            # It died before it could report (before elastic.init(): an unknown flag, an
            # ImportError; or a script that never talks to its agent): the last line of its
            # standard error names what it died of.
            slot.report = report = {**report, "error": failure.process.last_error_line,
                                    "step": report.get("step", -1)}
        return self._handle(slot, failure, last_world)

    def _other_nodes(self, world: WorldRecord) -> list[str]:
        me = self._node()
        return [m.node for m in world.members if m.node != me]

    def _probe_peers(self, failure: PendingFailure) -> None:
        """Marks ``failure`` a peer's if another node of its world is dead (and drops that
        node's record, as a worker's suspicion would), or notes when they all answered."""
        world = failure.world
        if world is None:
            return
        verdict = self._probe_world(world)
        if verdict == "dead":
            failure.peer_node_dead = True
        elif verdict == "alive":
            failure.peers_answered_at = time.monotonic()
        self._wake()

    def _probe_world(self, world: WorldRecord) -> str:
        """Probes the other nodes of ``world``: ``"dead"`` if one is gone (it is evicted, as a
        worker's suspicion would), ``"alive"`` if all answer, ``"unknown"`` otherwise."""
        others = self._other_nodes(world)
        if self._evictor.check(others, world):
            return "dead"
        return "alive" if self._evictor.all_answer(others, world) else "unknown"

    def _peer_evidence(self, failure: PendingFailure) -> bool:
        """Whether a newer world names, as lost, a worker of another node that was in the
        failed worker's world, or another node of that world is dead (its agent's liveness
        port refuses): the failure was that peer's, not this worker's."""
        return failure.peer_node_dead or self._peers_lost_since(failure.world)

    def _peers_lost_since(self, before: WorldRecord | None) -> bool:
        """Whether a newer world than ``before`` names, as lost or evicted, a worker of
        another node that was in ``before``."""
        newest = self._newest_world()
        if before is None or newest is None or newest.epoch <= before.epoch:
            return False
        mine = self._node() + "/"
        others = {w for w in before.ranks() if not w.startswith(mine)}
        return bool(others & (set(newest.lost) | set(newest.evicted)))

    def _node_lost_since(self, before: WorldRecord | None) -> bool:
        """Whether the newest world names a worker of another node of ``before`` as lost
        and was written because a node was lost (not only its worker)."""
        newest = self._newest_world()
        return (newest is not None and newest.cause == "node_lost"
                and self._peers_lost_since(before))

    def _handle(self, slot: Slot, failure: PendingFailure,
                last_world: WorldRecord | None) -> bool:
        """Decides what the settled ``failure`` costs; returns False if the budget is
        exhausted."""
        process, code = failure.process, failure.code
        report = slot.report or {}
        # The newest world, not the last one followed: a mode upgrade (every worker now in
        # place) may have landed in this very tick.
        world = self._newest_world() or last_world
        in_place = world is not None and world.mode == "inplace" and slot.inplace
        if report.get("drained") or (process.stopping and not report.get("before_stop")):
            cause, delay = "stopped", 0.0
        elif report.get("peer"):
            cause, delay = "peer_failure", self.budget.backoff_base
        elif report.get("partition"):
            cause, delay = "partition", self.budget.backoff_base
        else:
            cause = "crash"
            charged = self.budget.charge()
            if charged is None:
                self.note(report)
                self.events.record("worker_failed", round=world.epoch if world else -1,
                                   exit_codes={slot.local_rank: code}, cause="crash",
                                   error=report.get("error"), budget_exhausted=True)
                logger.warning("worker %s failed (exit code %s: %s); the crash budget is "
                               "exhausted", slot.local_id, code,
                               report.get("error", "no report"))
                return False
            delay = charged
            self.restarts += 1
        if not in_place:
            # Restart mode: every node of the job restarts, and the next world waits for this
            # node's slots (or forms without them, and restarts everyone again when they
            # come): a backoff here stalls the whole job. A peer's failure or a partition is
            # no reason to wait (the leader decides the next world), and the first crash in
            # the window restarts at once, as torchrun does; repeated crashes back off 1 s,
            # 2 s, ... (the budget's series, one step later).
            delay = 0.0 if cause != "crash" or self.budget.recent() <= 1 else delay / 2
        if cause != "stopped":
            # A partition cut this node off: its workers' errors are no evidence of a bug.
            self._note_failure(report, failure.world, peer_node_dead=failure.peer_node_dead,
                               partitioned=cause == "partition")
            logger.warning("worker %s failed (exit code %s, %s: %s); restarting %s in %.1f s",
                           slot.local_id, code, cause, report.get("error", "no report"),
                           "it in place" if in_place else "this node's workers", delay)
            self.events.record("worker_failed", round=world.epoch if world else -1,
                               exit_codes={slot.local_rank: code}, cause=cause,
                               error=report.get("error"))
            self._broadcast(Gone((worker_id(self._node(), slot.local_id),)))
        if in_place:
            self._supervisor.restart_in_place(slot, delay)
        else:
            for other in self._supervisor.slots:
                if other is not slot and other.pending is not None:
                    self._restarted_after_exit(other)
            self._supervisor.restart_all(slot, delay)
        return True

    def _restarted_after_exit(self, slot: Slot) -> None:
        """Restart mode restarts this node's workers for another slot's failure while
        ``slot``'s worker had already exited and its failure was still being judged. That
        failure is of the same broken world, and the restart answers it. Judged later, it
        would be taken for a crash of the next incarnation and restart the node's workers
        again, fresh ones included (a benchmark's worker SIGKILL cost 20 s so). Its error
        still counts for the leader's "script bug" rule, as in
        :meth:`restarted_while_dying`."""
        failure = slot.pending
        assert failure is not None
        slot.pending = None
        report = dict(slot.report or {})
        if not report.get("error") and failure.process.last_error_line:
            report["error"] = failure.process.last_error_line
        self._note_failure(report, failure.world, peer_node_dead=failure.peer_node_dead)
        logger.warning("worker %s failed (exit code %s: %s) in the world this node's workers "
                       "now restart from", slot.local_id, failure.code,
                       report.get("error", "no report"))

    def _note_failure(self, report: Mapping[str, Any], world: WorldRecord | None, *,
                      peer_node_dead: bool = False, partitioned: bool = False) -> None:
        """Notes ``report``'s error for the leader's "script bug" rule, as the workers' own or
        not (see :meth:`note`).

        An error no dead peer causes is their own. One a dead peer causes (``peer_type``) is
        not when this node was cut off, another node of ``world`` was found dead, or a newer
        world names one lost with its node. Otherwise it is their own only if every other
        node of ``world`` answers a liveness probe, taken on a thread: a script that raises
        on every rank at once must still end the job, and each node sees the others' workers
        lost first; but a node killed whole takes its lease TTL to leave the records, and a
        world written meanwhile names only the survivors' workers lost, for they died first.
        """
        if not report.get("error"):
            return
        if report.get("peer_type") is False:
            self.note(report, own=True)
        elif partitioned or peer_node_dead or self._node_lost_since(world):
            self.note(report, own=False)
        elif world is None or not self._other_nodes(world):
            self.note(report, own=True)  # no peer of another node could have caused it
        else:
            threading.Thread(target=self._probe_then_note, args=(dict(report), world),
                             daemon=True, name="elastic-probe-failure").start()

    def _probe_then_note(self, report: dict[str, Any], world: WorldRecord) -> None:
        """:meth:`_note_failure`'s probe: evicts the dead nodes of ``world`` (as a worker's
        suspicion would), and notes the error as the workers' own only if all answer."""
        try:
            own = self._probe_world(world) == "alive" and not self._node_lost_since(world)
        except Exception:  # a probe that cannot be taken proves nothing: not their own
            logger.debug("could not probe the failed world's nodes", exc_info=True)
            own = False
        with self._supervisor.lock:
            self.note(report, own=own)
        self._publish()

    def note(self, report: Mapping[str, Any], *, own: bool = True) -> None:
        """Keeps the last error this node's workers died of for the leader's "script bug"
        rule. ``own`` is False for a worker that died of a peer's failure: survivors of one
        dead peer all report the same error text (naming that peer), which alone is no
        evidence of a bug in the script."""
        error = report.get("error")
        if not error:
            return
        step = int(report.get("step", -1))
        note = self.failure_note
        if note is not None and note.get("error") == error and note.get("step") == step:
            self.failure_note = {**note, "count": int(note.get("count", 1)) + 1,
                                 "own": bool(note.get("own", True)) or own}
        else:
            self.failure_note = {"step": step, "error": str(error), "count": 1, "own": own}

    def clear_past(self, step: int) -> bool:
        """A worker trained past the noted failure's step: forget it; returns whether it
        did (the record changes)."""
        note = self.failure_note
        if note is not None and step > int(note.get("step", -1)):
            self.failure_note = None
            return True
        return False

    def exhausted_outcome(self, others: bool) -> AgentOutcome:
        """This node's end when its budget ran out (``others``: other nodes go on)."""
        goes_on = ("it left the job, which goes on with the other nodes" if others
                   else "it left the job, and no other node is in it")
        return AgentOutcome(
            1, "budget_exhausted",
            f"this node's workers crashed {self.budget.recent()} times within "
            f"{self.budget.window:g} s (--max-restarts {self.budget.max_restarts}); "
            f"{goes_on}.")
