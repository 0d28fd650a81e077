"""The one agent that writes the world: elected by etcd, replaced the moment it is gone.

Election is a create-if-absent of the run's ``leader`` key on the candidate's own node
lease, so the key vanishes with the leader (a crash, a silent host, a clean exit) and the
survivors race to create it again: one attempt per agent per vacancy, one winner. Only the
leader mirrors the node records (a prefix watch); from them and the current world it computes
the next world (:func:`~elastic.rdzv.proposal.next_world`, the same on every agent) and writes
it by compare-and-swap on the world key's revision:

* a loss (a worker gone, evicted or departing) is written at once: survivors are waiting;
* growth (joiners) and the first world wait for the last-call settle: the proposal must stay
  the same for ``last_call`` seconds, so several joins become one reconfiguration;
* a world whose every worker turned in-place capable is rewritten with ``mode: inplace``
  (same epoch, same ranks);
* every member reporting the same failure at the same step (the script's own bug) ends the
  run at once (:func:`~elastic.rdzv.proposal.common_failure`);
* workers every other worker waits for (the progress rule) are left out of the next world
  (:func:`~elastic.rdzv.proposal.laggards`);
* a world whose process groups a member could not build (a member came too late, or died
  during the build) is written again under the next epoch, with a fresh store, once every
  member node reports the failed build or ``rebuild_after`` seconds after the first report
  (:func:`~elastic.rdzv.proposal.failed_builds`): otherwise every member would wait for a
  newer world that no membership change brings.

A CAS the leader loses (a deposed leader, a duplicate after a retry) costs nothing: the watch
brings the winner's world and the loop decides again from it.

Every world write is also fenced by the writer's term: the same transaction compares the
leader key's create revision with the one this node's election created. A leader frozen past
its lease (a stopped process, a long pause) and then resumed would otherwise send the write it
had decided before it froze; while the next leader has nothing to write, the world key's
revision still matches, and that stale world (a node that left since, say) would be written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Final

from elastic.etcd import EtcdClient, PrefixWatch, WatchEvent
from elastic.rdzv.keys import JobKeys
from elastic.rdzv.node import NodeMembership
from elastic.rdzv.proposal import (
    Change,
    classify,
    common_failure,
    failed_builds,
    laggards,
    next_world,
)
from elastic.rdzv.records import EndRecord, NodeRecord, WorldRecord, parse_nodes
from elastic.rdzv.view import JobView
from elastic_errors import EtcdUnavailableError

__all__ = ["LeaderLoop", "LeaderStats", "RunLimits"]

logger = logging.getLogger(__name__)

_IDLE_WAKE_S: Final = 1.0


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
    """

    min_nodes: int
    max_nodes: int
    last_call: float = 1.0
    rebuild_after: float = 10.0


@dataclass
class LeaderStats:
    """What leading cost (read by tests and the rendezvous benchmark)."""

    cas_attempts: int = 0
    cas_won: int = 0
    election_attempts: int = 0
    worlds_written: list[int] = field(default_factory=list)


class LeaderLoop:
    """Campaigns for leadership and, while leading, writes the run's worlds.

    Args:
        client: The etcd client.
        keys: The run's keys.
        node: This agent's membership (its lease carries the leader key).
        view: The run's control keys.
        limits: Node counts and settle time.
        end_run: Called to end the run when every member failed the same way.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, node: NodeMembership,
                 view: JobView, limits: RunLimits,
                 end_run: Callable[[EndRecord], object]) -> None:
        self._client = client
        self._keys = keys
        self._node = node
        self._view = view
        self._limits = limits
        self._end_run = end_run
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._nodes: PrefixWatch | None = None
        self._pending: tuple[tuple[str, ...], str] | None = None
        self._pending_since = 0.0
        self._used_stores: set[tuple[str, int]] = set()
        self._ended = False
        #: The world this leader wrote last: newer than the view until the watch delivers it,
        #: and deciding from the older one would write a duplicate that can only fail.
        self._written: WorldRecord | None = None
        self._evicting: tuple[str, ...] = ()
        #: The create revision of the leader key this node's election wrote: its term, which
        #: every world write is fenced by (``None`` while not leading).
        self._term: int | None = None
        #: (epoch, when) of the first failed build reported for the current world.
        self._rebuild_since: tuple[int, float] | None = None
        #: Worker incarnations evicted by the progress rule: never admitted again (their agent
        #: kills them; until it has, their node record still shows them ready).
        self._evicted: set[str] = set()
        #: Nodes seen announcing a planned departure. A departing node revokes its lease as it
        #: goes, so its record (and its ``departing`` note) can vanish before the world that
        #: its leaving breaks is written: that world must still call it a departure.
        self._departing: set[str] = set()
        self._reported: set[str] = set()
        self._parsed: dict[str, tuple[int, NodeRecord | None]] = {}
        self.stats = LeaderStats()
        self.leading = False
        view.add_listener(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="elastic-leader", daemon=True)

    def start(self) -> None:
        """Starts the loop's thread."""
        self._thread.start()

    def stop(self) -> None:
        """Stops leading (the leader key goes with the node's lease)."""
        self._stop.set()
        self._wake.set()
        if self._nodes is not None:
            self._nodes.cancel()

    def poke(self) -> None:
        """Makes the loop decide again now (e.g. after this node's own record changed)."""
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout = _IDLE_WAKE_S
            try:
                if self._view.end() is not None:
                    return
                if self._campaign():
                    timeout = self._lead()
            except EtcdUnavailableError as exc:
                logger.warning("leader loop: etcd unavailable (%s); retrying", exc)
            except Exception:  # the loop must outlive any single bad decision
                logger.exception("leader loop failed; retrying")
            self._wake.wait(timeout)
            self._wake.clear()
        self._abdicate()

    def _campaign(self) -> bool:
        """Whether this node leads, trying to become the leader if nobody does."""
        me = self._node.record.node
        lease = self._node.lease
        current = self._view.leader()
        if current == me and lease is not None and not lease.lost.is_set():
            if not self.leading:
                kv = self._view.leader_kv()
                if kv is None:
                    return False
                self._become_leader(kv.create_revision)
            return True
        if self.leading:
            self._abdicate()
        if current is not None or lease is None or lease.lost.is_set():
            return False
        self.stats.election_attempts += 1
        # A leader key that names no leader (foreign or damaged) is replaced, by revision.
        invalid = self._view.leader_kv()
        won, elected = self._client.cas(self._keys.leader, me.encode(),
                                        invalid.mod_revision if invalid is not None else None,
                                        lease=lease.id)
        if won and elected is not None:
            self._become_leader(elected.create_revision)
        return won

    def _become_leader(self, term: int) -> None:
        self.leading = True
        self._term = term
        self._pending = None
        self._written = None
        self._nodes = self._client.watch_prefix(self._keys.nodes, on_change=self._on_nodes)
        logger.info("node %s leads run %s", self._node.record.node, self._keys.root)

    def _abdicate(self) -> None:
        if self._nodes is not None:
            self._nodes.cancel()
            self._nodes = None
        self.leading = False
        self._term = None

    def _on_nodes(self, events: Sequence[WatchEvent]) -> None:
        self._wake.set()

    def node_records(self) -> list[NodeRecord]:
        """The live node records (leader only; empty otherwise)."""
        watch = self._nodes
        if watch is None:
            return []
        # Every decision needs all of them, so each value is parsed once, not once per
        # decision: with N nodes joining, parsing all of them every time would cost O(N^2).
        parsed: dict[str, tuple[int, NodeRecord | None]] = {}
        records = []
        for kv in watch.items().values():
            hit = self._parsed.get(kv.key)
            if hit is None or hit[0] != kv.mod_revision:
                found = parse_nodes([(kv.key, kv.value, kv.create_revision)],
                                    on_error=self._report_once)
                hit = (kv.mod_revision, found[0] if found else None)
            parsed[kv.key] = hit
            if hit[1] is not None:
                records.append(hit[1])
        self._parsed = parsed
        return records

    def _report_once(self, exc: Exception) -> None:
        """Logs a node key that holds no node record, once (every decision parses it)."""
        message = str(exc)
        if message not in self._reported:
            self._reported.add(message)
            logger.warning("ignored: %s", message)

    def _lead(self) -> float:
        """One decision; returns how long to sleep if nothing changes meanwhile."""
        nodes = self.node_records()
        if self._view.world_error() is not None:  # the world key holds no world record
            self._written = None
            # Once replaced, the watch brings the new world (and wakes this loop).
            self._replace_invalid_world(nodes)
            return _IDLE_WAKE_S
        current = self._view.world()
        written = self._written
        if written is not None and (current is None or current.revision < written.revision):
            current = written
        if not self._ended and (ended := self._run_over(current, nodes)) is not None:
            self._ended = True
            self._end_run(ended)
            return _IDLE_WAKE_S
        self._departing |= {n.node for n in nodes if n.departing is not None}
        if current is not None:
            self._evicted |= set(current.evicted)  # a previous leader's evictions too
            # Only nodes of the current world can still depart from it.
            self._departing &= {w.split("/")[0] for w in current.ranks()}
        if current is not None and current.members and not self._ended:
            slow = laggards(current, nodes)
            if slow:
                self._evicted |= set(slow)
                self._evicting = slow
                logger.warning("evicting worker(s) %s: every other worker has waited for "
                               "them in the step's collective past the hang threshold",
                               ", ".join(slow))
        self._evicted &= {f"{n.node}/{w.local_id}" for n in nodes for w in n.workers}
        if self._evicted:
            nodes = _without_workers(nodes, sorted(self._evicted))
        proposal = next_world(current, nodes, min_nodes=self._limits.min_nodes,
                              max_nodes=self._limits.max_nodes, used_stores=self._used_stores)
        if proposal is None and current is not None and current.members:
            empty = _restart_all(current, nodes, self._departing)
            if empty.lost:
                # Too few nodes are left to train, but the survivors must still learn now
                # that their world is broken (and which workers caused it): an empty world.
                self._write(empty.with_changes(mode=current.mode), current)
                return 0.0
        change = classify(current, proposal)
        if change is Change.NONE and current is not None and proposal is not None:
            wait = self._rebuild_wait(current, nodes)
            if wait == 0.0:
                self._write(proposal.with_changes(mode=current.mode, cause="rebuild"), current)
                return 0.0
            if wait is not None:
                return wait
        if change is Change.NONE:
            self._pending = None
            if (proposal is not None and current is not None and current.mode == "restart"
                    and proposal.mode == "inplace"):
                # Same ranks, every worker now in-place capable: upgrade this epoch.
                self._write(current.with_changes(mode="inplace", departed=(), evicted=()),
                            current)
            return _IDLE_WAKE_S
        assert proposal is not None
        if current is not None and current.members and current.mode == "restart":
            # Restart mode: every worker of the world restarts on any change, so the world
            # goes through an empty epoch ("everyone restart") first, written at once for a
            # loss and after the settle for growth; the next real world is then formed from
            # the new incarnations once they settle. Writing the real world directly would
            # restart the workers into a world of stale incarnations, one change at a time.
            if change is Change.LOSS or self._settled(proposal, nodes):
                self._write(_restart_all(current, nodes, self._departing), current)
                return 0.0
            return self._remaining_settle()
        if change is Change.LOSS:
            evicted = tuple(w for w in self._evicting if w not in proposal.ranks())
            self._evicting = ()
            assert current is not None
            lost = tuple(w for w in current.ranks() if w not in proposal.ranks()
                         and w not in proposal.departed and w not in evicted)
            self._write(proposal.with_changes(evicted=evicted, lost=lost), current)
            return 0.0
        # After a restart-mode "everyone restart" world, the node records still show the
        # incarnations being restarted as ready until their agents publish the new ones: a
        # full world must settle too, or it is formed from stale incarnations, which makes
        # the agents restart again, and again (a storm of empty and full worlds).
        restarting = current is not None and not current.members and current.mode == "restart"
        if self._settled(proposal, nodes, shortcut=not restarting):
            self._write(proposal, current)
            return 0.0
        return self._remaining_settle()

    def _rebuild_wait(self, current: WorldRecord, nodes: Sequence[NodeRecord]
                      ) -> float | None:
        """``None`` if no member failed to build ``current``; else the seconds until it is
        written again (0: now)."""
        failed, everyone = failed_builds(current, nodes)
        if not failed:
            self._rebuild_since = None
            return None
        if self._rebuild_since is None or self._rebuild_since[0] != current.epoch:
            self._rebuild_since = (current.epoch, time.monotonic())
        if everyone:
            return 0.0
        return max(0.0, self._limits.rebuild_after
                   - (time.monotonic() - self._rebuild_since[1]))

    def _settled(self, proposal: WorldRecord, nodes: Sequence[NodeRecord], *,
                 shortcut: bool = True) -> bool:
        """Whether ``proposal`` stayed the same for the last call (or, with ``shortcut``,
        nobody else can come)."""
        signature = (proposal.ranks(), proposal.mode)
        if self._pending != signature:
            self._pending, self._pending_since = signature, time.monotonic()
        return self._remaining_settle() <= 0 or (shortcut and self._complete(nodes, proposal))

    def _remaining_settle(self) -> float:
        return max(0.0, self._limits.last_call - (time.monotonic() - self._pending_since))

    @staticmethod
    def _run_over(current: WorldRecord | None,
                  nodes: Sequence[NodeRecord]) -> EndRecord | None:
        """The run's end, when the node records show it: the script's own bug, or every
        member of the world done training (scripts that cannot tell their agent they
        finished: plain torch scripts)."""
        failure = common_failure(nodes)
        if failure is not None:
            when = (f"at step {failure.step}" if failure.step >= 0
                    else "before its first step")
            return EndRecord("failed", f"the training script failed on every worker {when}: "
                             f"{failure.error}", failure.step)
        if nodes and all(n.done for n in nodes):
            # Also after a loss left an empty world: whoever is still here is done.
            return EndRecord("finished", "every worker finished training")
        if current is None or not current.members:
            return None
        by_node = {n.node: n for n in nodes}
        if all((n := by_node.get(m.node)) is not None and n.done for m in current.members):
            return EndRecord("finished", "every worker finished training")
        return None

    def _complete(self, nodes: Sequence[NodeRecord], proposal: WorldRecord) -> bool:
        """Nobody else can come: max nodes, each with every slot ready (no need to settle)."""
        if len(proposal.members) < self._limits.max_nodes:
            return False
        by_node = {n.node: n for n in nodes}
        return all(
            (record := by_node.get(m.node)) is not None
            and len(m.workers) == len(record.workers)
            for m in proposal.members
        )

    def _write(self, proposal: WorldRecord, current: WorldRecord | None) -> None:
        if not proposal.cause:
            proposal = proposal.with_changes(cause=_cause(proposal, current,
                                                          self.node_records()))
        self.stats.cas_attempts += 1
        written, after = self._client.cas(
            self._keys.world, proposal.dumps(), current.revision if current else None,
            fence=self._fence())
        self._pending = None
        if written and after is not None:
            self._written = proposal.with_changes(revision=after.mod_revision)
            self.stats.cas_won += 1
            self.stats.worlds_written.append(proposal.epoch)
            self._used_stores.add(proposal.store)
            logger.info("world epoch %d (%s): %d worker(s) on %d node(s): %s", proposal.epoch,
                        proposal.mode, proposal.world_size, len(proposal.members),
                        ",".join(proposal.nodes()))

    def _fence(self) -> tuple[str, int]:
        """The world write's fence: this leader's term (see the module docstring)."""
        assert self._term is not None, "a world write outside a term"
        return self._keys.leader, self._term

    def _replace_invalid_world(self, nodes: Sequence[NodeRecord]) -> None:
        """The world key holds something that is not a world record: overwrite it.

        Its epoch is unknown, so the new epoch is the damaged key's mod revision, which is
        larger than any epoch written before it (each epoch took at least one revision):
        epochs stay increasing and no process-group store prefix is ever reused.
        """
        kv = self._view.world_kv()
        if kv is None:
            return
        proposal = next_world(None, nodes, min_nodes=self._limits.min_nodes,
                              max_nodes=self._limits.max_nodes, used_stores=self._used_stores)
        if proposal is None:
            return
        replacement = WorldRecord(kv.mod_revision, proposal.members, proposal.store,
                                  proposal.mode)
        self.stats.cas_attempts += 1
        written, _ = self._client.cas(self._keys.world, replacement.dumps(), kv.mod_revision,
                                      fence=self._fence())
        if written:
            self.stats.cas_won += 1
            logger.warning("replaced the invalid world record with epoch %d",
                           replacement.epoch)


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
                 departing: Set[str] = frozenset()) -> WorldRecord:
    """The empty world that makes every agent of a restart-mode world restart its workers;
    ``lost`` names the workers whose loss caused it, ``departed`` those of nodes that
    announced their departure (``departing``: also those whose record is gone since)."""
    ready = {f"{n.node}/{w.local_id}" for n in nodes for w in n.ready_workers()}
    leaving = set(departing) | {n.node for n in nodes if n.departing is not None}
    departed = tuple(w for w in current.ranks() if w.split("/")[0] in leaving)
    return WorldRecord(current.epoch + 1, (), current.store, "restart", departed=departed,
                       lost=tuple(w for w in current.ranks()
                                  if w not in ready and w not in departed))


def _without_workers(nodes: Sequence[NodeRecord], evicted: Sequence[str]) -> list[NodeRecord]:
    """The node records with ``evicted`` workers marked not ready (left out of a proposal)."""
    gone = set(evicted)
    updated = []
    for record in nodes:
        workers = tuple(
            w if f"{record.node}/{w.local_id}" not in gone
            else type(w)(w.local_rank, w.incarnation, False, w.inplace, w.pid)
            for w in record.workers
        )
        updated.append(record.with_changes(workers=workers) if workers != record.workers
                       else record)
    return updated
