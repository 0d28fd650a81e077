"""The leader's decisions, as one pure function: ``decide(current, nodes, memory, limits)``.

The leader loop (:mod:`membership.leader`) only reads (the world key, the node records, the
clock), calls :func:`decide`, and carries out the :data:`Action` it returns: a world written by
compare-and-swap on the current world's revision, the run's end, or a wait. Everything the
leader must remember between two decisions (a proposal settling, workers it evicted, nodes seen
departing, a failed build's first report, the stores it handed out) is the
:class:`LeaderMemory` it passes in and gets back. So every rule below can be tested as a table
of (world, records, memory, clock) -> (action, memory), with no etcd and no thread, and any
agent that becomes leader decides exactly as the one before it would have.

The rules, in order:

* the world key holds something that is not a world record: replace it (its epoch is the
  damaged key's revision, larger than any epoch before it);
* every member reports the same failure at the same step (the script's own bug), or every
  member is done: end the run (:mod:`membership.ending`);
* workers every other worker waits for (the progress rule) are evicted: left out of every
  later world;
* workers that finished training (exited 0) are neither ready nor lost: no later world names
  them (it could never be built), and their absence alone writes nothing (the others finish
  in their own time). If the rest cannot finish (a rank 0 whose final checkpoint was fenced
  off), the steps left are trained again by the workers that can still train;
* a loss (a worker gone, evicted or departing) is written at once: survivors are waiting.
  A loss that leaves fewer than ``min_nodes`` nodes writes the empty world (in place, the
  survivors wait with the state for enough nodes), except in place when the nodes short of
  the count are still there, restarting crashed workers (:func:`_present`): the world without
  those workers is written, and the restarted ones join it like any newcomer. Counting such a
  node as gone would stall every survivor until its new worker is ready (seconds of
  interpreter and model start-up) for one worker's crash;
* growth (joiners) and the first world wait for the last-call settle, unless nobody else can
  come (``max_nodes`` nodes, each with every slot ready);
* restart mode goes through the empty "everyone restart" world on any change, then forms the
  next world from the new incarnations as soon as every live node has published them
  (:func:`_everyone_restarted`), else once they settle;
* a world whose every worker turned in-place capable is rewritten with ``mode: inplace``;
* a world a member could not build is written again under the next epoch once every member
  reports the failed build, or ``rebuild_after`` seconds after the first report.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Final, TypeAlias

from elastic.contract.records import EndRecord, NodeRecord, WorldRecord
from membership.ending import run_end
from membership.proposal import (
    Change,
    classify,
    failed_builds,
    finished_workers,
    laggards,
    next_world,
)

__all__ = ["Action", "EndRun", "InvalidWorld", "LeaderMemory", "RunLimits", "Wait",
           "WriteWorld", "decide"]

#: How long the leader sleeps when nothing is pending (a watch event wakes it sooner).
IDLE_WAKE_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class RunLimits:
    """How many nodes a world may have, and how long joins settle.

    Attributes:
        min_nodes: Fewest nodes a world trains with.
        max_nodes: Most nodes a world takes (the rest wait).
        last_call: Seconds a growing proposal must stay unchanged before it is written.
        rebuild_after: Longest wait, after a member reported a failed build of the current
            world, for the other members' builds to end before the world is written again
            (the workers' build timeout: by then every member's build has ended).
        rejoin_grace: How long every live node must stay done before that alone ends the
            run (:func:`~membership.ending.run_end`; the node lease TTL).
    """

    min_nodes: int
    max_nodes: int
    last_call: float = 1.0
    rebuild_after: float = 10.0
    rejoin_grace: float = 3.0


@dataclass(frozen=True, slots=True)
class InvalidWorld:
    """The world key holds something that is not a world record (at ``revision``)."""

    revision: int


@dataclass(frozen=True, slots=True)
class LeaderMemory:
    """What the leader keeps between two decisions.

    Attributes:
        pending: The growing proposal being settled (its ranks and mode), if any.
        pending_since: When it was first proposed (the clock passed to :func:`decide`).
        used_stores: Store servers named by worlds this leader wrote (never handed out twice).
        ended: The run's end was decided.
        evicted: Worker incarnations evicted by the progress rule: never admitted again.
        evicting: The workers evicted by the current decision (named in the next world).
        departing: Nodes seen announcing a planned departure (a departing node revokes its
            lease as it goes, so its record can vanish before the world its leaving breaks).
        rebuild_since: ``(epoch, when)`` of the first failed build reported for a world.
        done_since: Since when every live node is done.
    """

    pending: tuple[tuple[str, ...], str] | None = None
    pending_since: float = 0.0
    used_stores: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    ended: bool = False
    evicted: frozenset[str] = field(default_factory=frozenset)
    evicting: tuple[str, ...] = ()
    departing: frozenset[str] = field(default_factory=frozenset)
    rebuild_since: tuple[int, float] | None = None
    done_since: float | None = None

    def wrote(self, world: WorldRecord) -> LeaderMemory:
        """The memory after ``world`` was written (its compare-and-swap won)."""
        return replace(self, used_stores=self.used_stores | {world.store})


@dataclass(frozen=True, slots=True)
class WriteWorld:
    """Write ``world`` by compare-and-swap on the world key's revision ``base`` (``None``:
    only if the key is absent)."""

    world: WorldRecord
    base: int | None


@dataclass(frozen=True, slots=True)
class EndRun:
    """End the run with ``record``."""

    record: EndRecord


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to write now; decide again after ``seconds`` (or on the next change)."""

    seconds: float


Action: TypeAlias = WriteWorld | EndRun | Wait


def decide(current: WorldRecord | InvalidWorld | None, nodes: Sequence[NodeRecord],
           memory: LeaderMemory, limits: RunLimits, *, now: float
           ) -> tuple[Action, LeaderMemory]:
    """The leader's next step (see the module docstring for the rules).

    Args:
        current: The current world (the newest of the watched one and the one this leader
            wrote last), :class:`InvalidWorld`, or ``None`` before the first.
        nodes: The live node records.
        memory: What the previous decision returned (``LeaderMemory()`` for a new leader).
        limits: Node counts and settle times.
        now: The clock (``time.monotonic()``): settle times are measured on it.

    Returns:
        What to do, and the memory to pass to the next decision.
    """
    if isinstance(current, InvalidWorld):
        return _replace_invalid(current, nodes, memory, limits)
    if not memory.ended:
        ended, since = run_end(current, nodes, done_since=memory.done_since,
                               grace=limits.rejoin_grace, now=now)
        memory = memory if since == memory.done_since else replace(memory, done_since=since)
        if ended is not None:
            return EndRun(ended), replace(memory, ended=True)
    action, memory = _next_world(current, nodes, memory, limits, now)
    if isinstance(action, Wait) and memory.done_since is not None:  # decide again in time
        action = Wait(max(0.0, min(action.seconds,
                                   limits.rejoin_grace - (now - memory.done_since))))
    return action, memory


def _next_world(current: WorldRecord | None, nodes: Sequence[NodeRecord], memory: LeaderMemory,
                limits: RunLimits, now: float) -> tuple[Action, LeaderMemory]:
    """The world to write next, if any (every rule but the run's end)."""
    memory, candidates = _remember(current, nodes, memory)
    finished = finished_workers(nodes)
    proposal = next_world(current, candidates, min_nodes=limits.min_nodes,
                          max_nodes=limits.max_nodes, used_stores=memory.used_stores)
    if (proposal is None and current is not None and current.members
            and current.mode == "inplace"):
        proposal = _without_restarting(current, candidates, memory, limits)
    if proposal is None and current is not None and current.members:
        empty = _restart_all(current, candidates, memory.departing, finished)
        if empty.lost:
            # Too few nodes are left to train, but the survivors must still learn now that
            # their world is broken (and which workers caused it): an empty world.
            return _write(empty.with_changes(mode=current.mode), current, nodes, memory)
    change = classify(current, proposal, finished=finished)
    if change is Change.NONE and current is not None and proposal is not None:
        wait, memory = _rebuild_wait(current, nodes, memory, limits, now, finished)
        if wait == 0.0:
            return _write(proposal.with_changes(mode=current.mode, cause="rebuild"), current,
                          nodes, memory)
        if wait is not None:
            return Wait(wait), memory
    if change is Change.NONE:
        memory = replace(memory, pending=None)
        if (proposal is not None and current is not None and current.mode == "restart"
                and proposal.mode == "inplace"):
            # Same ranks, every worker now in-place capable: upgrade this epoch.
            return _write(current.with_changes(mode="inplace", departed=(), evicted=()),
                          current, nodes, memory)
        return Wait(IDLE_WAKE_S), memory
    assert proposal is not None
    if current is not None and current.members and current.mode == "restart":
        # Restart mode: every worker of the world restarts on any change, so the world goes
        # through an empty epoch ("everyone restart") first, written at once for a loss and
        # after the settle for growth; the next real world is then formed from the new
        # incarnations once they settle. Writing the real world directly would restart the
        # workers into a world of stale incarnations, one change at a time.
        if change is Change.LOSS:
            return _write(_restart_all(current, candidates, memory.departing, finished),
                          current, nodes, memory)
        settled, memory = _settled(proposal, candidates, memory, limits, now)
        if settled:
            return _write(_restart_all(current, candidates, memory.departing, finished),
                          current, nodes, memory)
        return Wait(_remaining(memory, limits, now)), memory
    if change is Change.LOSS:
        assert current is not None
        evicted = tuple(w for w in memory.evicting if w not in proposal.ranks())
        memory = replace(memory, evicting=())
        lost = tuple(w for w in current.ranks() if w not in proposal.ranks()
                     and w not in proposal.departed and w not in evicted
                     and w not in finished)
        return _write(proposal.with_changes(evicted=evicted, lost=lost), current, nodes, memory)
    # After a restart-mode "everyone restart" world, the node records still show the
    # incarnations being restarted as running until their agents publish the new ones;
    # next_world leaves those out, so a complete world of new incarnations (every node,
    # every slot) is written at once, and anything less waits for the last call.
    settled, memory = _settled(proposal, candidates, memory, limits, now)
    restarting = current is not None and not current.members and current.mode == "restart"
    if settled or (restarting and _everyone_restarted(candidates, proposal, limits)):
        return _write(proposal, current, nodes, memory)
    return Wait(_remaining(memory, limits, now)), memory


def _everyone_restarted(nodes: Sequence[NodeRecord], proposal: WorldRecord,
                        limits: RunLimits) -> bool:
    """After restart mode's empty world: whether every live node has published fresh
    incarnations of all its slots (ready, not running yet), and ``proposal`` takes them all.

    Then nobody the last call could wait for is missing (the stale incarnations it guards
    against are running ones, and none is left), so the next world is written at once even
    below ``max_nodes``: otherwise every restart waits a last call for nodes that are not
    coming.
    """
    live = [n for n in nodes if n.departing is None]
    if not live or any(not n.workers or any(not w.ready or w.pid for w in n.workers)
                       for n in live):
        return False
    return len(proposal.members) == min(len(live), limits.max_nodes) and all(
        len(m.workers) == len(n.workers) for m in proposal.members
        for n in live if n.node == m.node)


def _remember(current: WorldRecord | None, nodes: Sequence[NodeRecord],
              memory: LeaderMemory) -> tuple[LeaderMemory, list[NodeRecord]]:
    """Updates departures and evictions; returns the memory and the records to propose from
    (evicted and finished workers marked not ready)."""
    departing = set(memory.departing) | {n.node for n in nodes if n.departing is not None}
    evicted, evicting = set(memory.evicted), memory.evicting
    if current is not None:
        evicted |= set(current.evicted)  # a previous leader's evictions too
        # Only nodes of the current world can still depart from it.
        departing &= {w.split("/")[0] for w in current.ranks()}
    if current is not None and current.members and not memory.ended:
        slow = laggards(current, nodes)
        if slow:
            evicted |= set(slow)
            evicting = slow
    evicted &= {f"{n.node}/{w.local_id}" for n in nodes for w in n.workers}
    memory = replace(memory, departing=frozenset(departing), evicted=frozenset(evicted),
                     evicting=evicting)
    left_out = evicted | finished_workers(nodes)
    return memory, (_without_workers(nodes, sorted(left_out)) if left_out else list(nodes))


def _present(current: WorldRecord, nodes: Sequence[NodeRecord]) -> set[str]:
    """Nodes of ``current`` that are still in the job: live and not departing. In place, a
    live member none of whose workers is ready is restarting a crashed one (its agent restarts
    it at once after the crash budget's backoff, or leaves the job when that is exhausted)."""
    live = {n.node for n in nodes if n.departing is None and not n.done}
    return {m.node for m in current.members if m.node in live}


def _without_restarting(current: WorldRecord, nodes: Sequence[NodeRecord],
                        memory: LeaderMemory, limits: RunLimits) -> WorldRecord | None:
    """In place: the world without crashed workers whose nodes are still present, when only
    those nodes keep the proposal below ``min_nodes`` (else ``None``)."""
    proposal = next_world(current, nodes, min_nodes=1, max_nodes=limits.max_nodes,
                          used_stores=memory.used_stores)
    if proposal is None:
        return None
    present = set(proposal.nodes()) | _present(current, nodes)
    return proposal if len(present) >= limits.min_nodes else None


def _replace_invalid(current: InvalidWorld, nodes: Sequence[NodeRecord],
                     memory: LeaderMemory, limits: RunLimits
                     ) -> tuple[Action, LeaderMemory]:
    """The world key holds something that is not a world record: overwrite it. Its epoch is
    unknown, so the new epoch is the damaged key's mod revision, which is larger than any
    epoch written before it: epochs stay increasing and no store prefix is ever reused."""
    proposal = next_world(None, nodes, min_nodes=limits.min_nodes,
                          max_nodes=limits.max_nodes, used_stores=memory.used_stores)
    if proposal is None:
        return Wait(IDLE_WAKE_S), memory
    replacement = WorldRecord(current.revision, proposal.members, proposal.store,
                              proposal.mode)
    return WriteWorld(replacement, current.revision), replace(memory, pending=None)


def _write(world: WorldRecord, current: WorldRecord | None, nodes: Sequence[NodeRecord],
           memory: LeaderMemory) -> tuple[Action, LeaderMemory]:
    if not world.cause:
        world = world.with_changes(cause=_cause(world, current, nodes))
    return (WriteWorld(world, current.revision if current is not None else None),
            replace(memory, pending=None))


def _rebuild_wait(current: WorldRecord, nodes: Sequence[NodeRecord], memory: LeaderMemory,
                  limits: RunLimits, now: float, finished: Set[str]
                  ) -> tuple[float | None, LeaderMemory]:
    """``None`` if no member failed to build ``current``; else the seconds until it is
    written again (0: now)."""
    failed, everyone = failed_builds(current, nodes, finished=finished)
    if not failed:
        return None, replace(memory, rebuild_since=None)
    since = memory.rebuild_since
    if since is None or since[0] != current.epoch:
        since = (current.epoch, now)
        memory = replace(memory, rebuild_since=since)
    if everyone:
        return 0.0, memory
    return max(0.0, limits.rebuild_after - (now - since[1])), memory


def _settled(proposal: WorldRecord, nodes: Sequence[NodeRecord], memory: LeaderMemory,
             limits: RunLimits, now: float) -> tuple[bool, LeaderMemory]:
    """Whether ``proposal`` stayed the same for the last call, or nobody else can come."""
    signature = (proposal.ranks(), proposal.mode)
    if memory.pending != signature:
        memory = replace(memory, pending=signature, pending_since=now)
    settled = _remaining(memory, limits, now) <= 0 or _complete(nodes, proposal, limits)
    return settled, memory


def _remaining(memory: LeaderMemory, limits: RunLimits, now: float) -> float:
    return max(0.0, limits.last_call - (now - memory.pending_since))


def _complete(nodes: Sequence[NodeRecord], proposal: WorldRecord, limits: RunLimits) -> bool:
    """Nobody else can come: max nodes, each with every slot ready (no need to settle)."""
    if len(proposal.members) < limits.max_nodes:
        return False
    by_node = {n.node: n for n in nodes}
    return all((record := by_node.get(m.node)) is not None
               and len(m.workers) == len(record.workers) for m in proposal.members)


def _cause(world: WorldRecord, current: WorldRecord | None,
           nodes: Sequence[NodeRecord]) -> str:
    """Why ``world`` follows ``current`` (for the event log and the metrics)."""
    if current is None:
        return "start"
    if not current.members:  # after restart mode's empty world: its cause is this one's
        return current.cause or "node_joined"
    if world.departed:
        return "planned_departure"
    if world.evicted:
        return "worker_evicted"
    if world.lost:
        live = {n.node for n in nodes}
        return ("node_lost" if any(w.split("/")[0] not in live for w in world.lost)
                else "worker_failed")
    if world.epoch == current.epoch:
        return current.cause
    return "node_joined"


def _restart_all(current: WorldRecord, nodes: Sequence[NodeRecord],
                 departing: Set[str] = frozenset(),
                 finished: Set[str] = frozenset()) -> WorldRecord:
    """The empty world that makes every agent of a restart-mode world restart its workers;
    ``lost`` names the workers whose loss caused it (never one that ``finished``),
    ``departed`` those of nodes that announced their departure (``departing``: also those
    whose record is gone since)."""
    ready = {f"{n.node}/{w.local_id}" for n in nodes for w in n.ready_workers()}
    leaving = set(departing) | {n.node for n in nodes if n.departing is not None}
    departed = tuple(w for w in current.ranks() if w.split("/")[0] in leaving)
    return WorldRecord(current.epoch + 1, (), current.store, "restart", departed=departed,
                       lost=tuple(w for w in current.ranks()
                                  if w not in ready and w not in departed
                                  and w not in finished))


def _without_workers(nodes: Sequence[NodeRecord], evicted: Sequence[str]) -> list[NodeRecord]:
    """The node records with ``evicted`` workers marked not ready (left out of a proposal)."""
    gone = set(evicted)
    updated = []
    for record in nodes:
        workers = tuple(
            w if f"{record.node}/{w.local_id}" not in gone
            else replace(w, ready=False)
            for w in record.workers
        )
        updated.append(record.with_changes(workers=workers) if workers != record.workers
                       else record)
    return updated
