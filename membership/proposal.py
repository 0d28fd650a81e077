"""What the next world should be: pure functions of the current world and the node records.

Any agent computes the same answer from the same inputs, so whichever agent writes it (the
leader, by compare-and-swap) writes what everyone would have written. Nothing here touches
etcd or a clock: callers pass ``now`` where time matters.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from elastic.contract.records import NodeRecord, WorldMember, WorldRecord, worker_id

__all__ = ["Change", "classify", "common_failure", "failed_builds", "finished_workers",
           "laggards", "next_world"]


def _candidates(nodes: Sequence[NodeRecord], current: WorldRecord | None,
                max_nodes: int) -> list[NodeRecord]:
    """Nodes that can train now, in rank order: survivors keep theirs, joiners follow.

    A departing node leaves an in-place world at once (its workers leave at a step
    boundary). A restart-mode world keeps it while its workers run: they are draining (a
    final checkpoint needs every rank), and it goes when they stop.
    """
    draining = (set(current.nodes()) if current is not None and current.mode == "restart"
                else set())
    usable = [n for n in nodes
              if n.ready_workers() and (n.departing is None or n.node in draining)]
    order = {node: index for index, node in enumerate(current.nodes())} if current else {}
    usable.sort(key=lambda n: (order.get(n.node, len(order)), n.create_revision, n.node))
    return usable[:max_nodes]


def _store_host(members: Sequence[NodeRecord], used: Collection[tuple[str, int]]
                ) -> tuple[str, int]:
    """The first member whose spare store server no world has used yet.

    An agent replaces its spare server once a world names it, but the leader may write the
    next world before that new port reaches etcd; a server is never handed to two worlds.
    """
    for node in members:
        if (node.addr, node.store_port) not in used:
            return node.addr, node.store_port
    return members[0].addr, members[0].store_port


def next_world(
    current: WorldRecord | None,
    nodes: Sequence[NodeRecord],
    *,
    min_nodes: int,
    max_nodes: int,
    used_stores: Collection[tuple[str, int]] = (),
) -> WorldRecord | None:
    """The world the job should train in now, or ``None`` if fewer than ``min_nodes`` can.

    Rules (the same on every agent):

    * a node takes part while it is live (its key exists), not departing, and has ready
      workers; only its ready workers join;
    * ranks are deterministic: nodes of the current world keep their order (survivors keep
      their ranks where possible), new nodes follow in join order (key create revision);
    * at most ``max_nodes`` nodes, and at most ``max_world`` workers where a node declares
      that cap (the global batch: more ranks than samples would leave ranks idle; the
      workers beyond the cap wait as spares);
    * the world reconfigures in place only if every one of its workers says it can;
    * after restart mode's empty world, which restarts every running worker, only workers
      that are not running yet are taken (agents start restart-mode workers once a world
      names them): a record that still shows a running worker was published before its
      agent saw the empty world, and a world naming it would be replaced as soon as that
      agent restarts it, and so on, agent after agent.

    Returns:
        The proposal with epoch ``current.epoch + 1``; compare it with
        :meth:`WorldRecord.same_composition` before writing it.
    """
    if current is not None and not current.members and current.mode == "restart":
        nodes = [n.with_changes(workers=tuple(replace(w, ready=False) if w.pid else w
                                              for w in n.workers)) for n in nodes]
    members = _candidates(nodes, current, max_nodes)
    caps = [n.max_world for n in members if n.max_world is not None]
    budget = min(caps) if caps else None
    chosen: list[tuple[NodeRecord, tuple[str, ...]]] = []
    inplace = True
    for node in members:
        ready = node.ready_workers()
        if budget is not None:
            ready = ready[: max(0, budget)]
            budget -= len(ready)
        if not ready:
            continue
        inplace = inplace and all(w.inplace for w in ready)
        chosen.append((node, tuple(w.local_id for w in ready)))
    if len(chosen) < min_nodes or not chosen:
        return None
    used = set(used_stores)
    departed: tuple[str, ...] = ()
    if current is not None:
        used.add(current.store)
        leaving = {n.node for n in nodes if n.departing is not None}
        departed = tuple(w for m in current.members if m.node in leaving
                         for w in (worker_id(m.node, x) for x in m.workers))
    return WorldRecord(
        epoch=(current.epoch if current else 0) + 1,
        members=tuple(WorldMember(n.node, n.addr, workers, n.probe_port)
                      for n, workers in chosen),
        store=_store_host([n for n, _ in chosen], used),
        mode="inplace" if inplace else "restart",
        departed=departed,
    )


class Change(str, Enum):
    """How a proposal differs from the current world, which decides when to write it.

    * ``NONE``: the same workers; nothing to write (a mode upgrade aside).
    * ``LOSS``: a worker of the current world is gone (dead, evicted, departing, not ready):
      write at once, survivors are waiting.
    * ``GROWTH``: only new workers: write after the last-call settle, so that several joins
      become one reconfiguration.
    * ``FIRST``: no world yet: write after the settle (more nodes may be on their way).
    """

    NONE = "none"
    LOSS = "loss"
    GROWTH = "growth"
    FIRST = "first"


def classify(current: WorldRecord | None, proposal: WorldRecord | None, *,
             finished: Collection[str] = frozenset()) -> Change:
    """Classifies ``proposal`` against ``current`` (see :class:`Change`).

    Workers of ``current`` that ``finished`` training are neither kept nor lost: a proposal
    that only leaves them out changes nothing (see :mod:`membership.decide`).
    """
    if proposal is None:
        # Nobody can train; if the current world lost members, its survivors wait.
        return Change.NONE
    if current is None or not current.members:
        return Change.FIRST
    kept = tuple(w for w in current.ranks() if w not in finished)
    if proposal.ranks() == kept:
        return Change.NONE
    if set(kept) - set(proposal.ranks()):
        return Change.LOSS
    return Change.GROWTH


@dataclass(frozen=True, slots=True)
class CommonFailure:
    """Every active node's workers died of the same error at the same step: the script's bug."""

    step: int
    error: str


def common_failure(nodes: Sequence[NodeRecord]) -> CommonFailure | None:
    """The script's own bug, if every active node reports the same failure.

    A node's ``failure`` note is ``{"step", "error", "count"}``: the last exception its
    workers died of, and how many times it recurred (its agent clears the note once a worker
    trains past that step). It is the script's bug when every node that is not departing
    reports the same error at the same step, seen at least twice in all (two workers, or one
    worker twice): one crash of one worker is not evidence, it costs that node's crash
    budget instead. At least one of the notes must be a worker's own failure (``own``, true
    when absent): workers that all died of one dead peer report the same error too.
    """
    active = [n for n in nodes if n.departing is None and n.workers]
    if not active or any(n.failure is None for n in active):
        return None
    if not any(bool(n.failure.get("own", True)) for n in active if n.failure is not None):
        return None
    seen = {(int(n.failure.get("step", -1)), str(n.failure.get("error", "")))
            for n in active if n.failure is not None}
    if len(seen) != 1:
        return None
    count = sum(int(n.failure.get("count", 1)) for n in active if n.failure is not None)
    if count < 2:
        return None
    step, error = seen.pop()
    return CommonFailure(step, error)


def laggards(world: WorldRecord, nodes: Sequence[NodeRecord]) -> tuple[str, ...]:
    """Workers that hold the step back: every other worker waits for them (progress rule).

    A node reports ``waiting = {epoch, step, workers}`` once some of its workers have waited
    in a step's collective for longer than the hang threshold. When, for this world, the
    waiting workers at one step are all but a few, those few are evicted: they are alive
    (their agent's lease holds) yet make no progress. A world where *every* worker waits
    has no laggard (a network partition between peers): nothing is decided here.

    Returns:
        Job-wide worker ids (:func:`~elastic.contract.records.worker_id`) of the laggards.
    """
    by_node = {n.node: n for n in nodes}
    waiting: dict[int, set[str]] = {}
    for member in world.members:
        record = by_node.get(member.node)
        note = record.waiting if record is not None else None
        if not note or note.get("epoch") != world.epoch:
            continue
        ids = {worker_id(member.node, w) for w in note.get("workers", ()) if w in member.workers}
        waiting.setdefault(int(note.get("step", -1)), set()).update(ids)
    if not waiting:
        return ()
    step = max(waiting)
    held = waiting[step]
    everyone = world.ranks()
    behind = tuple(w for w in everyone if w not in held)
    # Evict only a minority: if most workers are not waiting, the "waiting" ones are the
    # odd ones out (or the step is just long), and evicting the majority would be wrong.
    if not behind or len(behind) * 2 > len(everyone):
        return ()
    return behind


def finished_workers(nodes: Sequence[NodeRecord]) -> frozenset[str]:
    """Job-wide ids of the workers that finished training (exited 0)."""
    return frozenset(worker_id(n.node, w.local_id) for n in nodes for w in n.workers
                     if w.finished)


def failed_builds(world: WorldRecord, nodes: Sequence[NodeRecord], *,
                  finished: Collection[str] = frozenset()) -> tuple[set[str], bool]:
    """The member nodes of ``world`` that could not build its process groups, and whether
    that is every live member node (then nobody is still building it). A member whose
    workers of ``world`` all ``finished`` training builds nothing: it does not count.

    Only a world with members counts (an empty world has no groups). A restart-mode world
    counts too: its workers were started for it and no agent restarts them while its
    composition stands, so a member slower than the build timeout (a worker still importing
    on a loaded host) would otherwise leave every member waiting for a newer world for good.
    """
    if not world.members:
        return set(), False
    by_node = {n.node: n for n in nodes}
    live = [m.node for m in world.members if m.node in by_node
            and not all(worker_id(m.node, w) in finished for w in m.workers)]
    failed = {node for node in live
              if (epoch := by_node[node].failed_build) is not None and epoch >= world.epoch}
    return failed, bool(failed) and len(failed) == len(live)
