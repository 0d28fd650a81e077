"""Following the run: its worlds, this node's lease, and etcd outages.

One part of the node agent (``docs/agent.md`` has the map). It reads membership
(:class:`~membership.job.RunMembership`) and tells the workers what they need from it (the
world, whether they may commit), but starts and stops nothing: the agent passes each new
world on to the supervisor.

* **A new world.** Its peers' liveness ports are learnt, the store server it names on this
  node is claimed, and a round that includes this node is recorded in the event log.
* **The lease.** A lease not refreshed for a while (etcd unreachable) only stops checkpoint
  commits: it is not lost yet (etcd renews every lease when it comes back from an outage).
  One that etcd dropped (etcd stalled past the TTL, a long pause, a cut link) is replaced by
  membership itself: the node joins again under the same id and its workers keep their
  processes and their state. In place they stay in their world if nobody moved on, or are
  admitted again as newcomers and healed by their peers if the others did; either way no
  checkpoint is read. Commits stay fenced until the node is back and its view of the run has
  caught up (:meth:`~membership.job.RunMembership.in_sync`).
* **etcd unreachable for the etcd deadline.** If this node's workers trained on meanwhile,
  etcd itself is gone for the whole job: the node stops, naming the endpoints (exit 3). If
  they stopped training when the others must have dropped it, the node was cut off: it keeps
  trying to reach etcd (up to ``join_timeout``), then follows the run again or ends with the
  run's outcome if the run ended meanwhile (:mod:`membership.cutoff`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from elastic.contract.messages import Lease
from elastic.contract.records import WorldRecord
from elastic.eventlog import EventLog
from elastic_errors import EtcdUnavailableError
from launch.agent_config import AgentConfig, AgentOutcome
from launch.evictions import PeerEvictor
from launch.stores import StorePool
from membership.cutoff import Reconnect, cut_off, ended_while_away, peers_answer
from membership.job import RunMembership

__all__ = ["WorldFollower"]

logger = logging.getLogger(__name__)


class WorldFollower:
    """This node's view of the run, as the agent acts on it.

    Args:
        config: The agent's settings.
        events: The job event log.
        stores: The node's store servers (a world may name its spare).
        evictor: Learns each world's peers.
        node: This node's id.
        broadcast: Sends a message to this node's workers.
        publish: Rewrites this node's record (when its spare store changed).
    """

    def __init__(self, config: AgentConfig, events: EventLog, stores: StorePool,
                 evictor: PeerEvictor, *, node: Callable[[], str],
                 broadcast: Callable[[Lease], None], publish: Callable[[], None]) -> None:
        self.config = config
        self.events = events
        self._stores = stores
        self._evictor = evictor
        self._node = node
        self._broadcast = broadcast
        self._publish = publish
        #: The last world this node followed.
        self.last_world: WorldRecord | None = None
        #: The last world with members this node followed (restart mode passes empty ones).
        self.last_with_members: WorldRecord | None = None
        #: Worlds this node took part in (epochs), for tests and the report.
        self.epochs: list[int] = []
        #: ``time.monotonic()`` when a worker last reported a new step (``None``: never).
        self.progress_at: float | None = None
        #: Set (from a keep-alive thread) when etcd dropped this node's lease.
        self.lease_lost = threading.Event()
        self._no_world_since = time.monotonic()
        self._change_reason = "start"
        self._pushed_lease_ok = True
        self._reconnect: Reconnect | None = None

    @property
    def epoch(self) -> int:
        """The epoch of the last world followed (-1: none yet)."""
        return self.last_world.epoch if self.last_world is not None else -1

    @property
    def riding_out_a_cut(self) -> bool:
        """Whether it follows the run again after the watch gave up (see :meth:`cut_off`)."""
        return self._reconnect is not None

    def follow(self, run: RunMembership) -> WorldRecord | None:
        """Takes in the newest world; returns it if it is new to this node."""
        world = run.world()
        if world is None or (self.last_world is not None
                             and world.revision == self.last_world.revision):
            return None
        previous, self.last_world = self.last_world, world
        if world.members:
            self.last_with_members = world
        # Learn which peers answer a liveness probe, so that their refusal is trusted later.
        self._evictor.learn(world)
        if world.store[0] == self.config.addr and self._stores.claim(world.store[1],
                                                                     world.epoch):
            self._publish()
        if previous is None or world.epoch != previous.epoch:
            self._change_reason = world.cause or self._change_reason  # else a mode upgrade
        node = self._node()
        if world.member(node) is not None:
            self._no_world_since = time.monotonic()
            if previous is None or previous.epoch != world.epoch:
                self.epochs.append(world.epoch)
                self.events.record("round_started", round=world.epoch,
                                   group_rank=world.node_rank(node),
                                   world=len(world.members), workers=world.world_size,
                                   mode=world.mode, reason=self._change_reason)
                self._change_reason = "node_joined"
        return world

    def check_lease(self, run: RunMembership, rejoined: bool) -> None:
        """Tells the workers whether they may commit (see the module docstring); notes a
        lost lease and a return."""
        fresh = run.in_sync()
        if fresh != self._pushed_lease_ok:
            self._pushed_lease_ok = fresh
            self._broadcast(Lease(fresh))
        if self.lease_lost.is_set():
            self.lease_lost.clear()
            logger.warning("etcd dropped this node from the run (its lease expired): it joins "
                           "again as node %s; its workers keep their state", self._node())
            self.events.record("lease_lost", node_id=self._node(), workers_kept=True)
        if rejoined:
            self._no_world_since = time.monotonic()
            logger.info("joined again as node %s (the same id: its workers keep their state)",
                        self._node())
            self._publish()

    def check_join_timeout(self, run: RunMembership) -> AgentOutcome | None:
        """The node's end when no world has included it for ``join_timeout`` seconds."""
        world = run.world()
        if world is not None and world.member(self._node()) is not None:
            # The wait counts from the last moment this node was in a world, not from when
            # it joined that world: a world that trained longer than join_timeout, then
            # broke, must not end the node on the spot.
            self._no_world_since = time.monotonic()
            return None
        waited = time.monotonic() - self._no_world_since
        if waited < self.config.join_timeout:
            return None
        return AgentOutcome(
            3, "rendezvous_error",
            f"this node found no world to train in for {waited:.0f} s (fewer than "
            f"--min-nodes ({self.config.min_nodes}) nodes could train); check that the other "
            "nodes are running, or lower --min-nodes.")

    def cut_off(self, run: RunMembership) -> AgentOutcome | None:
        """etcd could not be watched for the etcd deadline: stop on a job-wide outage, or
        ride out a cut (see the module docstring); returns the outcome if the run ended
        meanwhile.

        Raises:
            EtcdUnavailableError: On a job-wide outage, or when etcd stayed unreachable for
                ``join_timeout`` seconds.
        """
        reconnect = self._reconnect
        if reconnect is None and _etcd_answers(run):
            # The main loop can be late here (a put of this node's record waits out the
            # deadline too): if etcd answers by now there is no outage to report, and the
            # evidence below (peers answering again) would be stale.
            logger.warning("etcd's watch gave up after the etcd deadline, but etcd answers "
                           "again: following the run again")
            self._reconnect = Reconnect(run, give_up_after=self.config.join_timeout)
            return None
        if reconnect is None:
            self._judge_the_outage(run)
            self._reconnect = Reconnect(run, give_up_after=self.config.join_timeout)
            return None
        if not reconnect.done.is_set():
            return None
        self._reconnect = None
        if reconnect.error is not None:
            raise EtcdUnavailableError(
                f"etcd ({run.client.endpoints_text}) could not be reached for "
                f"{self.config.join_timeout:.0f} s after this node was cut off from the job "
                f"(last error: {reconnect.error}); check the network between this node and "
                "etcd.")
        logger.info("etcd answers again: following the run again")
        if run.view.end() is not None:
            return None  # the run's end record is still there: the agent finishes with it
        ended = ended_while_away(reconnect.generation, run.keys.generation)
        if ended is None:
            return None  # the run goes on (a lost lease: membership joins again)
        code, outcome, message = ended
        logger.warning("%s", message)
        return AgentOutcome(code, outcome, message)

    def _judge_the_outage(self, run: RunMembership) -> None:
        """Raises on a job-wide outage; returns if this node is the one cut off."""
        lease = run.node.lease
        refreshed = lease.last_refreshed if lease is not None else None
        answering = None
        if self.progress_at is None or refreshed is None:
            world = run.world()
            me = self._node()
            answering = peers_answer([(m.addr, m.probe_port) for m in (
                world.members if world is not None else ())
                if m.node != me and m.probe_port])
        if not cut_off(self.progress_at, refreshed, self.config.ttl, answering):
            error = run.view.watch.error
            raise error if error is not None else EtcdUnavailableError("etcd watch failed")
        logger.warning(
            "etcd (%s) has not answered for the etcd deadline, and %s: this node is cut off "
            "from the job, not witnessing an etcd outage; it keeps trying to reach etcd for up "
            "to %.0f s (join_timeout)", run.client.endpoints_text,
            "no other node answers" if answering is False else "this node's workers stopped "
            "training when the others must have dropped it", self.config.join_timeout)

    def stop(self) -> None:
        """Stops riding out a cut (the agent is stopping)."""
        if self._reconnect is not None:
            self._reconnect.stop()


def _etcd_answers(run: RunMembership) -> bool:
    """Whether etcd answers right now (one quick status call, about 2 s at most)."""
    try:
        run.client.status(deadline=timedelta(seconds=2))
    except EtcdUnavailableError:
        return False
    return True
