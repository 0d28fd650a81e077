"""elastic-run's node agent: one per node, owner of the node's membership and of its workers.

The agent speaks the membership protocol of :mod:`membership` (the only process of the node
that talks to etcd), starts and watches each worker slot on its own, and tells its workers
their world over the local channel (:mod:`launch.channel`). It is made of parts with narrow
interfaces (``docs/agent.md`` names each and what it may touch):

* :class:`~launch.world_follower.WorldFollower` follows the run: worlds, the lease, etcd
  outages;
* :class:`~launch.supervisor.Supervisor` starts, watches and stops the worker slots;
* :class:`~launch.failure_judge.FailureJudge` decides what a failed worker costs, with the
  node's crash budget;
* :class:`~launch.evictions.PeerEvictor` evicts peer nodes that are gone, through
  :meth:`~membership.job.RunMembership.evict`;
* :class:`~launch.departures.Departures` carries out preemption notices and stop signals.

What stays here is the main loop (:meth:`NodeAgent.run`), the node record it publishes, the
run's end, and a dispatch table from each typed message a worker sends
(:mod:`elastic.contract.messages`) to the part that acts on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic.contract.messages import (
    BuildFailed,
    Declare,
    Drained,
    End,
    Exiting,
    Failure,
    Finished,
    Hello,
    Progress,
    Ready,
    Resumed,
    Stalled,
    Suspect,
    Waiting,
    Welcome,
    WorkerMessage,
    World,
)
from elastic.contract.records import EndRecord, NodeRecord, worker_id
from elastic.eventlog import EventLog
from elastic_errors import EtcdUnavailableError
from launch.agent_config import AgentConfig, AgentOutcome
from launch.channel import ChannelServer, WorkerConnection
from launch.departures import Departures
from launch.evictions import PeerEvictor
from launch.failure_judge import FailureJudge
from launch.run_end import came_late, finish
from launch.slot_state import Slot
from launch.slots import SlotProcess, WorkerCommand
from launch.stores import StorePool
from launch.supervisor import Supervisor
from launch.world_follower import WorldFollower
from membership.decide import RunLimits
from membership.etcd import EtcdClient
from membership.generation import open_run
from membership.job import RunMembership, new_node_id
from membership.keys import JobKeys
from membership.liveness import LivenessSocket
from membership.silent_peers import STALL_RULE

__all__ = ["AgentConfig", "AgentOutcome", "NodeAgent"]

logger = logging.getLogger(__name__)

#: A handler of one message kind: returns whether the node record must be written again.
_Handler = Callable[[WorkerConnection, Slot, Any], bool]


class NodeAgent:
    """Runs this node's part of a job (see the module docstring).

    Args:
        config: The agent's settings.
        client: The etcd client (the only one on the node).
        command: What every worker runs.
        events: The job event log.
    """

    def __init__(self, config: AgentConfig, client: EtcdClient, command: WorkerCommand,
                 events: EventLog) -> None:
        self.config = config
        self.client = client
        self.events = events
        self._wake = threading.Event()
        self._publish_due = threading.Event()  # a worker's message changed the node record
        self._rejoined = threading.Event()
        self._run: RunMembership | None = None
        self._node = new_node_id()
        self._said_done = False
        self._stores = StorePool(config.addr)
        self._liveness = LivenessSocket(config.addr if config.addr != "127.0.0.1" else "")
        self._channel = ChannelServer(self._on_message, lambda _c: self._wake.set(),
                                      accept=lambda pid: self._supervisor.is_worker(pid))
        self._supervisor = Supervisor(config, command, events, node=lambda: self._node,
                                      channel_path=lambda: self._channel.path,
                                      may_start=lambda: not self._departures.leaving)
        self._departures = Departures(config, self._supervisor, events, wake=self._wake.set)
        self._evictor = PeerEvictor(lambda: self._run, lambda: self._node, config.ttl)
        self._follower = WorldFollower(config, events, self._stores, self._evictor,
                                       node=lambda: self._node,
                                       broadcast=self._channel.broadcast,
                                       publish=self._publish)
        self._judge = FailureJudge(config, self._supervisor, self._evictor, events,
                                   node=lambda: self._node, run=lambda: self._run,
                                   still_connected=self._still_connected,
                                   broadcast=self._channel.broadcast, wake=self._wake.set,
                                   publish=self._request_publish)
        supervisor, evictor = self._supervisor, self._evictor
        #: Each message kind a worker sends, and the part that acts on it.
        self._handlers: dict[type[Any], _Handler] = {
            Hello: self._on_hello, Exiting: supervisor.on_exiting, Ready: supervisor.on_ready,
            Declare: supervisor.on_declare, Waiting: supervisor.on_waiting,
            BuildFailed: supervisor.on_build_failed, Progress: self._on_progress,
            Stalled: evictor.on_stalled, Resumed: self._on_resumed, Suspect: evictor.on_suspect,
            Failure: self._on_failure, Drained: lambda _c, slot, m: self._judge.drained(slot, m),
            Finished: self._on_finished,
        }
        #: When the agent's process started (the event log's origin), set by the runner.
        self.launched_at: float | None = None
        #: Which preemption notices this node watches (for the event log).
        self.preemption_watch: list[str] = []

    @property
    def node(self) -> str:
        """This node's id (it keeps it when it joins again after losing its lease)."""
        return self._node

    @property
    def channel_path(self) -> str:
        """The workers' channel socket."""
        return self._channel.path

    @property
    def epochs(self) -> list[int]:
        """Worlds this node took part in (epochs)."""
        return self._follower.epochs

    def request_departure(self, notice: Any) -> None:
        """Leave the job on ``notice`` (any thread; the main loop does the work, once)."""
        self._departures.request_departure(notice)

    def request_stop(self, signum: int) -> None:
        """Stop on a signal (SIGTERM, SIGINT): the workers get it too and drain (a final
        checkpoint, agreed by every rank), then this node leaves. Signal-safe."""
        self._departures.request_stop(signum)

    # -- the node record --------------------------------------------------------------------

    def _record(self) -> NodeRecord:
        supervisor = self._supervisor
        with supervisor.lock:
            return NodeRecord(
                node=self._node, host=socket.gethostname(), addr=self.config.addr,
                agent_pid=os.getpid(), store_port=self._stores.spare_port,
                probe_port=self._liveness.port, workers=supervisor.published(),
                max_world=supervisor.max_world, departing=self._departures.note(),
                waiting=supervisor.waiting_note(), failure=self._judge.failure_note,
                failed_build=supervisor.failed_build, restarts=self._judge.restarts,
                done=supervisor.all_finished(), metrics_port=self.config.metrics_port)

    def _publish(self) -> None:
        """Writes this node's record if anything changed (one put)."""
        run = self._run
        if run is None or run.node.lost:
            return  # membership writes it again as it joins again
        if run.view.watch.failed.is_set():
            # etcd has not answered for the etcd deadline: a put would wait out another
            # deadline and delay the main loop's decision (stop, or ride out a cut); the
            # record is written again once the run is followed again.
            return
        record = self._record()
        try:
            run.update(**{f: getattr(record, f) for f in (
                "store_port", "workers", "max_world", "departing", "waiting", "failure",
                "failed_build", "restarts", "done")})
        except EtcdUnavailableError as exc:
            logger.warning("could not publish this node's record (%s)", exc)

    # -- the channel: one handler per message kind ------------------------------------------

    def _on_message(self, connection: WorkerConnection, message: WorkerMessage) -> None:
        handler = self._handlers.get(type(message))
        with self._supervisor.lock:
            slot = self._supervisor.slot_of(connection)
            if slot is None or handler is None:
                return
            publish = handler(connection, slot, message)
        if publish:
            self._request_publish()

    def _request_publish(self) -> None:
        """Asks the main loop to write this node's record (any thread)."""
        # The main loop writes it: a put may wait out the etcd deadline (a node cut off), and
        # the asking thread must go on meanwhile (a healthy worker was replaced as silent
        # while its channel thread waited on etcd).
        self._publish_due.set()
        self._wake.set()

    def _on_hello(self, connection: WorkerConnection, slot: Slot, _: Hello) -> bool:
        slot.connected, slot.connected_at = True, time.monotonic()
        run = self._run
        end = run.view.end() if run is not None else None
        connection.send(Welcome(
            node=self._node, worker=worker_id(self._node, slot.local_id), stall=STALL_RULE,
            world=run.world() if run is not None else None,
            lease_ok=run.in_sync() if run is not None else True,
            end=End(end.outcome, end.reason, end.step) if end is not None else None))
        return False

    def _on_progress(self, _: WorkerConnection, slot: Slot, message: Progress) -> bool:
        if message.step >= 0 and message.step != slot.step:
            # Workers report completed steps only (a new worker's restored or healed step is
            # no evidence that it trains), and -1 before they complete one: a replacement's
            # first report differs from its slot's last step, but it is no progress (a node
            # cut off from the job, whose worker was replaced meanwhile, took it for training
            # on through an etcd outage).
            self._follower.progress_at = time.monotonic()
        slot.step = message.step
        return self._judge.clear_past(slot.step)

    def _on_resumed(self, _: WorkerConnection, slot: Slot, __: Resumed) -> bool:
        self._evictor.resumed()
        return self._supervisor.on_resumed(slot)

    def _on_failure(self, connection: WorkerConnection, slot: Slot, message: Failure) -> bool:
        self._judge.reported(slot, message)
        if message.fatal:  # a verdict on the whole job (JobFatalError)
            self._end(EndRecord("failed", message.error, message.step))
        return False

    def _on_finished(self, _: WorkerConnection, slot: Slot, message: Finished) -> bool:
        self._end(EndRecord("finished", "training finished", message.step))
        return False

    def _push_world(self) -> None:
        """Passes the newest world (or the run's end) to the workers, on every control-key
        change (from the watch thread)."""
        run = self._run
        if run is None:
            return
        world, end = run.world(), run.view.end()
        if end is not None:
            self._channel.broadcast(End(end.outcome, end.reason, end.step))
        elif world is not None:
            self._channel.broadcast(World(world))
        self._wake.set()

    # -- what the parts ask -----------------------------------------------------------------

    def _still_connected(self, process: SlotProcess) -> bool:
        """Whether the channel still has an open connection from ``process``."""
        connection = self._channel.connection(process.local_rank)
        return connection is not None and connection.pid == process.pid

    def _other_nodes(self) -> bool:
        """Whether the job has other nodes (the newest world with members says)."""
        world = self._run.world() if self._run is not None else None
        if world is None or not world.members:
            world = self._follower.last_with_members
        return world is not None and any(m.node != self._node for m in world.members)

    # -- the main loop ----------------------------------------------------------------------

    def run(self) -> AgentOutcome:
        """Runs this node's part of the job; returns how it ended."""
        config = self.config
        opened = open_run(self.client, JobKeys(config.key_prefix, config.job_id),
                          linger=config.linger)
        if opened.ended is not None:
            return came_late(config.job_id, opened.ended)
        self._run = RunMembership(
            self.client, opened.keys,
            limits=RunLimits(config.min_nodes, config.max_nodes, config.last_call,
                             rebuild_after=config.build_timeout, rejoin_grace=config.ttl),
            ttl=config.ttl, linger=config.linger, on_change=self._push_world,
            on_lease_lost=self._lease_lost, on_rejoined=self._on_rejoined,
            rejoin_timeout=config.join_timeout)
        self._supervisor.tick_standbys()  # the standbys import torch while the node joins
        self._supervisor.prepare_join(self._run.world())
        self._run.join(self._record())
        self.events.record("agent_started", node_id=self._node,
                           generation=opened.keys.generation, min_nodes=config.min_nodes,
                           max_nodes=config.max_nodes, nproc_per_node=config.nproc_per_node,
                           max_restarts=config.budget.max_restarts,
                           preemption_watch=self.preemption_watch,
                           launched_at=self.launched_at)
        try:
            while True:
                outcome = self._tick(self._run)
                if outcome is not None:
                    return outcome
                self._wake.wait(config.monitor_interval)
                self._wake.clear()
        finally:
            self._shutdown()

    def _lease_lost(self) -> None:
        self._follower.lease_lost.set()
        self._wake.set()

    def _on_rejoined(self) -> None:
        self._rejoined.set()
        self._wake.set()

    def _tick(self, run: RunMembership) -> AgentOutcome | None:
        follower, supervisor = self._follower, self._supervisor
        if run.view.watch.failed.is_set() or follower.riding_out_a_cut:
            outcome = follower.cut_off(run)
            if outcome is not None:
                return outcome
        end = run.view.end()
        if end is not None:
            return finish(end, self._supervisor, self.events, self.config.job_id,
                          self._follower.epoch)
        rejoined = self._rejoined.is_set()
        self._rejoined.clear()
        follower.check_lease(run, rejoined)
        if self._publish_due.is_set():
            self._publish_due.clear()
            self._publish()
        outcome = self._departures.stop_if_signalled()
        if outcome is not None:
            return outcome
        self._reap()
        if self._judge.exhausted:
            return self._judge.exhausted_outcome(self._other_nodes())
        supervisor.check_heartbeats(self._channel.connections(), self.config.ttl)
        supervisor.tick_standbys()
        world = follower.follow(run)
        if world is not None:
            supervisor.kill_evicted(world)
            changed = supervisor.clear_stale_waiting(world)
            if world.mode != "inplace":
                with supervisor.lock:
                    changed |= supervisor.follow_restart_mode(
                        world, self._departures.leaving, self._judge.restarted_while_dying,
                        self._publish)
            if changed:
                self._publish()
        last = follower.last_world
        outcome = self._departures.depart_if_noticed(
            last is not None and last.mode == "inplace", follower.epoch, self._publish)
        if outcome is not None:
            return outcome
        if supervisor.start_due(last, run.world()):
            self._publish()
        if supervisor.all_finished():
            if not self._said_done:
                self._said_done = True
                logger.info("this node's workers finished training; waiting for the rest of "
                            "the job")
            return None  # no later world names it: no join timeout while the rest finish
        return follower.check_join_timeout(run)

    def _reap(self) -> None:
        """Hands exited workers to the failure judge, and settles pending failures."""
        supervisor, judge = self._supervisor, self._judge
        now = time.monotonic()
        with supervisor.lock:
            failed, exited = supervisor.exits()
            for slot, process, code in failed:
                judge.failed(slot, process, code, slot.started_for or self._follower.last_world)
            exhausted = any(slot.pending is not None and not judge.settle(
                slot, now, self._follower.last_world) for slot in supervisor.slots)
        if exhausted:
            supervisor.kill_all()
            judge.exhausted = True
            self._wake.set()
        elif exited:
            self._publish()

    # -- the end ----------------------------------------------------------------------------

    def _end(self, end: EndRecord) -> None:
        run = self._run
        if run is None:
            return
        try:
            run.end(end)
        except EtcdUnavailableError as exc:
            logger.warning("could not record the end of the run (%s)", exc)

    def _shutdown(self) -> None:
        self._supervisor.close_standbys()
        self._supervisor.kill_all()
        self._follower.stop()
        run = self._run
        if run is not None:
            with contextlib.suppress(Exception):
                run.leave()
        self._evictor.close()
        self._channel.close()
        self._liveness.close()
        self._stores.close()
