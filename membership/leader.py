"""The one agent that writes the world: elected by etcd, replaced the moment it is gone.

Election is a create-if-absent of the run's ``leader`` key on the candidate's own node
lease, so the key vanishes with the leader (a crash, a silent host, a clean exit) and the
survivors race to create it again: one attempt per agent per vacancy, one winner. Only the
leader mirrors the node records (a prefix watch). Its loop only reads, decides and writes: it
reads the world and the node records, asks :func:`~membership.decide.decide` (a pure
function, the same on every agent) what to do, and writes the world by compare-and-swap on
the world key's revision, ends the run, or waits. The rules live in :mod:`membership.decide`.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from elastic.contract.records import EndRecord, NodeRecord, WorldRecord, parse_nodes
from elastic_errors import EtcdUnavailableError
from membership.decide import (
    IDLE_WAKE_S,
    EndRun,
    InvalidWorld,
    LeaderMemory,
    RunLimits,
    Wait,
    WriteWorld,
    decide,
)
from membership.etcd import EtcdClient, PrefixWatch, WatchEvent
from membership.keys import JobKeys
from membership.node import NodeMembership
from membership.view import JobView

__all__ = ["LeaderLoop", "LeaderStats"]

logger = logging.getLogger(__name__)



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
        #: What the leader keeps between decisions (see :class:`LeaderMemory`).
        self.memory = LeaderMemory()
        #: The world this leader wrote last: newer than the view until the watch delivers it,
        #: and deciding from the older one would write a duplicate that can only fail.
        self._written: WorldRecord | None = None
        self._reported: set[str] = set()
        self._parsed: dict[str, tuple[int, NodeRecord | None]] = {}
        self.stats = LeaderStats()
        self.leading = False
        #: The create revision of the leader key this node's election wrote: its term, which
        #: every world write is fenced by (``None`` while not leading).
        self._term: int | None = None
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
            timeout = IDLE_WAKE_S
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
        if (current is None and self.leading and self._term is not None
                and lease is not None and not lease.lost.is_set()
                and self._view.revision < self._term):
            return True  # the view has not caught up with the election this node just won
        if current == me and lease is not None and not lease.lost.is_set():
            kv = self._view.leader_kv()
            if kv is None or kv.lease != lease.id:
                # The key of a lease this node lost (it joined again on a new one): that term
                # is over, and the key goes with the old lease.
                if self.leading:
                    self._abdicate()
                return False
            if self.leading and self._term != kv.create_revision:
                # Elected again under the same name (the view may show the new key without
                # the old one's deletion, after a resync): write in the new term only.
                self._abdicate()
            if not self.leading:
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
        self.memory = replace(self.memory, pending=None)
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
        """One decision (read, decide, write); returns how long to sleep if nothing changes
        meanwhile."""
        nodes = self.node_records()
        current: WorldRecord | InvalidWorld | None
        if self._view.world_error() is not None:  # the world key holds no world record
            self._written = None
            kv = self._view.world_kv()
            if kv is None:
                return IDLE_WAKE_S
            current = InvalidWorld(kv.mod_revision)
        else:
            current = self._view.world()
            written = self._written
            if written is not None and (current is None
                                        or current.revision < written.revision):
                current = written
        before = self.memory.evicting
        action, self.memory = decide(current, nodes, self.memory, self._limits,
                                     now=time.monotonic())
        if self.memory.evicting and self.memory.evicting != before:
            logger.warning("evicting worker(s) %s: every other worker has waited for them in "
                           "the step's collective past the hang threshold",
                           ", ".join(self.memory.evicting))
        if isinstance(action, EndRun):
            self._end_run(action.record)
            return IDLE_WAKE_S
        if isinstance(action, WriteWorld):
            self._write(action)
            return 0.0
        assert isinstance(action, Wait)
        return action.seconds

    def _write(self, action: WriteWorld) -> None:
        proposal = action.world
        self.stats.cas_attempts += 1
        written, after = self._client.cas(self._keys.world, proposal.dumps(), action.base,
                                          fence=self._fence())
        if written and after is not None:
            self._written = proposal.with_changes(revision=after.mod_revision)
            self.memory = self.memory.wrote(proposal)
            self.stats.cas_won += 1
            self.stats.worlds_written.append(proposal.epoch)
            logger.info("world epoch %d (%s): %d worker(s) on %d node(s): %s", proposal.epoch,
                        proposal.mode, proposal.world_size, len(proposal.members),
                        ",".join(proposal.nodes()))

    def _fence(self) -> tuple[str, int]:
        """The world write's fence: this leader's term (see the module docstring)."""
        assert self._term is not None, "a world write outside a term"
        return self._keys.leader, self._term
