"""elastic-run's node agent: one per node, owner of the node's membership and of its workers.

It replaces torch's ``LocalElasticAgent`` (whose private hooks the previous design leaned
on): the agent speaks the membership protocol of :mod:`membership` itself, starts and
watches each worker slot on its own (:mod:`launch.slots`) and is the only process of the
node that talks to etcd; workers learn their world over the local channel
(:mod:`launch.channel`).

What happens when:

* **A world changes.** In place (every worker of the world uses ``ElasticLoop``), the
  agent only passes the new world to its workers, which reconfigure themselves at a step
  boundary, or at once if a member of their world is gone. In restart mode, the agent stops
  its workers and starts new ones for the next world that includes them.
* **A worker crashes.** The crash is charged to the node's budget (:mod:`launch.budget`),
  unless the worker reported that it died of a peer's failure. In place only that worker is
  restarted (a new incarnation joins the running world and is healed by a survivor); its
  node's other workers keep their processes. In restart mode the node's workers restart.
  A node whose crashes exceed the budget leaves the job like a departing node; the others go
  on. When every active node reports the same error at the same step, the run ends at once
  with that error (the script's own bug: restarting would only repeat it).
* **A worker falls silent.** A worker that sent no heartbeat for the lease TTL (SIGSTOPped,
  a frozen host thread) is killed and replaced, like a crash but not charged.
* **A worker holds the step back.** The leader evicts workers every other worker waits for
  (the progress rule, :func:`membership.proposal.laggards`); their agent kills them and
  starts new incarnations.
* **The node's lease is lost** (a partition from etcd longer than the TTL). The others have
  dropped the node; its workers are stopped (they must not train in a stale world or commit
  a checkpoint) and the node joins again under a new id once etcd answers.
* **etcd is unreachable for the etcd deadline.** If this node's workers trained on meanwhile,
  etcd itself is gone for the whole job: the node stops, naming the endpoints (exit 3). If
  they stopped training when the others must have dropped it, the node was cut off: it keeps
  trying to reach etcd (up to ``join_timeout``), then joins again or ends with the run's
  outcome if the run ended meanwhile (:mod:`membership.cutoff`).
* **A preemption notice.** In place, the node announces it is departing; the leader writes
  a world without it (marked *departed*, a planned change), the node's workers leave at the
  next step boundary, and the survivors go on without restarting or reading storage. In
  restart mode the workers drain (final checkpoint) first.
* **The run ends.** The first agent that knows writes the run's end record: the rank-0
  worker finished, every member is done, or the script failed everywhere; every agent then
  exits with the run's outcome, naming its reason.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from elastic import env
from elastic.contract.messages import (
    BuildFailed,
    Declare,
    Drained,
    End,
    Exiting,
    Failure,
    Finished,
    Gone,
    Hello,
    Lease,
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
from elastic.contract.records import EndRecord, NodeRecord, WorkerSlot, WorldRecord, worker_id
from elastic.eventlog import EventLog
from elastic_errors import EtcdUnavailableError
from launch.budget import CrashBudget
from launch.channel import ChannelServer, WorkerConnection
from launch.slots import SlotProcess, WorkerCommand, stop_all
from launch.stores import StorePool
from membership.cutoff import Reconnect, cut_off, ended_while_away, peers_answer
from membership.decide import RunLimits
from membership.etcd import EtcdClient
from membership.generation import open_run
from membership.job import RunMembership, new_node_id
from membership.keys import JobKeys
from membership.liveness import LivenessSocket, ProbeBook
from membership.silent_peers import (
    ETCD_CHECK_DEADLINE,
    STALL_RULE,
    SilentPeerWatch,
    confirmed_silent,
    lease_unrefreshed,
    watched_peers,
)

__all__ = ["AgentConfig", "AgentOutcome", "NodeAgent"]

logger = logging.getLogger(__name__)

_FINISH_GRACE_S: Final = 30.0
_RETRY_REJOIN_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything the agent needs from the command line.

    Attributes:
        job_id: The job id.
        key_prefix: elastic-run's etcd key prefix.
        min_nodes: Fewest nodes a world trains with.
        max_nodes: Most nodes a world takes.
        nproc_per_node: Worker slots on this node.
        addr: The address peers dial to reach this node.
        ttl: Node lease TTL, and a worker's heartbeat timeout, in seconds.
        last_call: Seconds joins settle before a world grows.
        join_timeout: Seconds this node may wait without a world before it gives up.
        monitor_interval: Seconds between two looks at the workers.
        budget: The node's crash budget.
        mode: ``auto``, ``inplace`` or ``restart`` (``--elastic-mode``).
        shutdown_grace: Seconds between SIGTERM and SIGKILL when stopping workers.
        drain_timeout: On a preemption notice, the longest the workers get to leave.
        linger: Seconds after a run's end during which a node that comes late exits instead
            of starting a fresh run of the job id (0: never).
        worker_env: Extra environment for every worker (in-place tuning, events, ...).
        metrics_port: The agent's Prometheus port, published in the node record.
        build_timeout: Seconds a world's process groups wait for every member
            (``--inplace-build-timeout``); after a failed build the leader waits at most this
            long for the other members' builds to fail too before writing the world again.
    """

    job_id: str
    key_prefix: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    addr: str
    ttl: int = 3
    last_call: float = 1.0
    join_timeout: float = 600.0
    monitor_interval: float = 0.1
    budget: CrashBudget = field(default_factory=CrashBudget)
    mode: str = "auto"
    shutdown_grace: float = 30.0
    drain_timeout: float = 60.0
    linger: int = 0
    worker_env: Mapping[str, str] = field(default_factory=dict)
    metrics_port: int | None = None
    build_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """How this node's part of the job ended.

    Attributes:
        code: The process exit code.
        outcome: ``succeeded``, ``failed``, ``departed``, ``already_finished``, ...
        message: One sentence for the user (the last line of the output when it failed).
    """

    code: int
    outcome: str
    message: str


@dataclass
class _Failure:
    """A worker's failure whose cause is not settled yet (a peer's, or its own)."""

    process: SlotProcess
    code: int
    world: WorldRecord | None
    decide_by: float
    #: Whether this node's lease was fresh when the worker failed (see ``_settle``).
    lease_fresh: bool = True
    probed: bool = False
    peer_node_dead: bool = False


@dataclass
class _Slot:
    """The agent's view of one worker slot."""

    local_rank: int
    incarnation: int = 0
    process: SlotProcess | None = None
    ready: bool = False
    inplace: bool = False
    restart_at: float | None = None
    started_for: WorldRecord | None = None
    report: dict[str, Any] | None = None
    step: int = -1
    waiting: dict[str, Any] | None = None
    finished: bool = False
    pending: _Failure | None = None

    def published(self) -> WorkerSlot:
        pid = self.process.pid if self.process is not None else 0
        return WorkerSlot(self.local_rank, self.incarnation, self.ready, self.inplace, pid)

    @property
    def local_id(self) -> str:
        return f"{self.local_rank}.{self.incarnation}"


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
        self.command = command
        self.events = events
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._slots = [_Slot(i) for i in range(config.nproc_per_node)]
        self._budget = config.budget
        self._stores = StorePool(config.addr)
        self._liveness = LivenessSocket(config.addr if config.addr != "127.0.0.1" else "")
        self._probes = ProbeBook()
        self._silent_peers = SilentPeerWatch(self._check_silent_peers,
                                             limit=config.ttl + 1.0)
        self._channel = ChannelServer(self._on_message, self._on_disconnect,
                                      accept=self._is_worker)
        self._run: RunMembership | None = None
        self._node = new_node_id()
        self._lease_lost = threading.Event()
        self._departure: Any = None
        self._departing_since: float | None = None
        self._last_world: WorldRecord | None = None
        self._failure_note: dict[str, Any] | None = None
        self._failed_build: int | None = None
        self._max_world: int | None = None
        self._restarts = 0
        self._no_world_since = time.monotonic()
        self._pushed_lease_ok = True
        self._exhausted = False
        self._stop_signal: int | None = None
        self._stop_since: float | None = None
        self._said_done = False
        self._change_reason = "start"
        #: ``time.monotonic()`` when a worker last reported a new step (``None``: never).
        self._progress_at: float | None = None
        #: Following the run again after the watch gave up (this node was cut off).
        self._reconnect: Reconnect | None = None
        #: Worlds this node took part in (epochs), for tests and the report.
        self.epochs: list[int] = []
        #: When the agent's process started (the event log's origin), set by the runner.
        self.launched_at: float | None = None
        #: Which preemption notices this node watches (for the event log).
        self.preemption_watch: list[str] = []

    # -- identity ---------------------------------------------------------------------------

    @property
    def node(self) -> str:
        """This node's id (changes when the node joins again after losing its lease)."""
        return self._node

    @property
    def channel_path(self) -> str:
        """The workers' channel socket."""
        return self._channel.path

    def _is_worker(self, pid: int) -> bool:
        """Whether ``pid`` is one of this agent's workers (or a descendant of one)."""
        with self._lock:
            roots = {s.process.pid for s in self._slots if s.process is not None}
        for _ in range(8):  # worker_guard runs the script in the worker process itself
            if pid in roots:
                return True
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    pid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
            if pid <= 1:
                return False
        return False

    def _record(self) -> NodeRecord:
        with self._lock:
            return NodeRecord(
                node=self._node, host=socket.gethostname(), addr=self.config.addr,
                agent_pid=os.getpid(), store_port=self._stores.spare_port,
                probe_port=self._liveness.port,
                workers=tuple(s.published() for s in self._slots),
                max_world=self._max_world,
                departing=self._departure_note(),
                waiting=self._waiting_note(), failure=self._failure_note,
                failed_build=self._failed_build,
                restarts=self._restarts,
                done=all(s.finished for s in self._slots),
                metrics_port=self.config.metrics_port,
            )

    def _publish(self) -> None:
        """Writes this node's record if anything changed (one put)."""
        run = self._run
        if run is None or self._lease_lost.is_set():
            return
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

    def _departure_note(self) -> dict[str, Any] | None:
        notice = self._departure
        if notice is None:
            return None
        deadline = getattr(notice, "deadline", None)
        return {"source": getattr(notice, "source", "notice"),
                "deadline": deadline.isoformat() if deadline is not None else None}

    def _waiting_note(self) -> dict[str, Any] | None:
        notes = [(s.waiting, s.local_id) for s in self._slots if s.waiting is not None]
        if not notes:
            return None
        epoch = max(int(n["epoch"]) for n, _ in notes)
        step = max(int(n["step"]) for n, _ in notes if int(n["epoch"]) == epoch)
        workers = [lid for n, lid in notes
                   if int(n["epoch"]) == epoch and int(n["step"]) == step]
        return {"epoch": epoch, "step": step, "workers": sorted(workers)}

    # -- the channel ------------------------------------------------------------------------

    def _slot_of(self, connection: WorkerConnection) -> _Slot | None:
        if not 0 <= connection.local_rank < len(self._slots):
            return None
        slot = self._slots[connection.local_rank]
        return slot if slot.incarnation == connection.incarnation else None

    def _welcome(self, connection: WorkerConnection) -> None:
        run = self._run
        world = run.world() if run is not None else None
        end = run.view.end() if run is not None else None
        connection.send(Welcome(
            node=self._node,
            worker=worker_id(self._node, f"{connection.local_rank}.{connection.incarnation}"),
            stall=STALL_RULE, world=world,
            lease_ok=run.node.fresh() if run is not None else True,
            end=End(end.outcome, end.reason, end.step) if end is not None else None))

    def _on_message(self, connection: WorkerConnection, message: WorkerMessage) -> None:
        publish = False
        with self._lock:
            slot = self._slot_of(connection)
            if slot is None:
                return
            if isinstance(message, Hello):
                self._welcome(connection)
                return
            if isinstance(message, Exiting):
                connection.exiting = True
                return
            if isinstance(message, Ready):
                slot.ready = True
                slot.inplace = message.inplace
                publish = True
            elif isinstance(message, Declare):
                slot.inplace = message.inplace
                publish = True
            if isinstance(message, Ready | Declare) and message.max_world is not None:
                self._max_world = message.max_world
            if isinstance(message, Progress):
                step = message.step
                if step >= 0 and step != slot.step:
                    # Workers report completed steps only (a new worker's restored or healed
                    # step is no evidence that it trains), and -1 before they complete one:
                    # a replacement's first report differs from its slot's last step, but
                    # it is no progress (a node cut off from the job, whose worker was
                    # replaced meanwhile, took it for training on through an etcd outage).
                    self._progress_at = time.monotonic()
                slot.step = step
                publish = self._clear_failure_past(slot.step)
            elif isinstance(message, Waiting):
                slot.waiting = {"epoch": message.epoch, "step": message.step}
                publish = True
            elif isinstance(message, Stalled):
                self._silent_peers.stalled(message.epoch, message.step)
            elif isinstance(message, Resumed):
                self._silent_peers.resumed()
                publish = slot.waiting is not None
                slot.waiting = None
            elif isinstance(message, BuildFailed):
                if self._failed_build is None or message.epoch > self._failed_build:
                    self._failed_build = message.epoch
                    publish = True
            elif isinstance(message, Failure):
                # A report that came before this agent stopped the worker is the worker's
                # own failure, even if the stop then ended it (a restart racing its death).
                slot.report = {"error": message.error, "step": message.step,
                               "peer": message.peer, "peer_type": message.peer_type,
                               "before_stop": slot.process is not None
                               and not slot.process.stopping}
                if message.fatal:  # a verdict on the whole job (JobFatalError)
                    self._end(EndRecord("failed", message.error, message.step))
            elif isinstance(message, Drained):
                # Stopped at a step boundary after a final checkpoint (a peer's notice, or
                # this node's): not a failure, whatever its exit code.
                slot.report = {"drained": True, "step": message.step}
            elif isinstance(message, Finished):
                self._end(EndRecord("finished", "training finished", message.step))
            elif isinstance(message, Suspect):
                threading.Thread(target=self._check_suspects, args=(list(message.nodes),),
                                 daemon=True, name="elastic-suspects").start()
        if publish:
            self._publish()

    def _on_disconnect(self, connection: WorkerConnection) -> None:
        self._wake.set()

    def _clear_failure_past(self, step: int) -> bool:
        note = self._failure_note
        if note is not None and step > int(note.get("step", -1)):
            self._failure_note = None
            return True
        return False

    def _check_suspects(self, nodes: list[str], world: WorldRecord | None = None, *,
                        silent: bool = False) -> bool:
        """Removes the records of suspected nodes whose agent is gone.

        A worker whose collective failed names its world's other nodes. A node whose whole
        process tree died (an OOM kill, a crashed container) has nobody left to revoke its
        lease: its agent's liveness port now refuses, which is certain, so its lease is
        revoked at once instead of expiring after the TTL. That removes its record and, if it
        led the run, the leader key too (deleting the record alone would leave the run
        without a leader to write the next world until the lease expired). A silent host
        answers nothing (unknown): with ``silent`` (this node's workers wait for it in a
        collective) it goes too once etcd has had no keep-alive of its lease for a whole
        period (:mod:`membership.silent_peers`); otherwise its lease decides.

        Args:
            nodes: The suspected nodes.
            world: The world whose records give their addresses (default: the current one).
            silent: Whether a node that answers no probe may be removed as well.

        Returns:
            Whether any of them was found gone.
        """
        run = self._run
        if world is None and run is not None:
            world = run.world()
        if run is None or world is None:
            return False
        addresses = {m.node: (m.addr, m.probe_port) for m in world.members
                     if m.node in nodes and m.node != self._node and m.probe_port}
        dead, unanswered = self._probes.recheck(addresses.values())
        found = bool(dead)
        # Silent checks run while the workers are stuck: a node that cannot reach etcd at
        # once is the cut-off one, and must not sit on etcd's whole deadline.
        deadline = ETCD_CHECK_DEADLINE if silent else None
        for node, address in addresses.items():
            if address not in dead and not (silent and address in unanswered):
                continue
            with contextlib.suppress(EtcdUnavailableError):
                kv = run.client.get(run.keys.node(node), deadline=deadline)
                if address in dead:
                    why = "its agent's liveness port refuses"
                elif kv is None:
                    found = True  # already gone: its lease expired meanwhile
                    continue
                elif kv.lease and confirmed_silent(
                        functools.partial(lease_unrefreshed, run.client, kv.lease),
                        functools.partial(self._probe_unanswered, address)):
                    why = ("its host answers no probe and etcd has had no keep-alive of its "
                           "lease for over a keep-alive period")
                else:
                    continue
                if kv is not None and kv.lease:
                    run.client.revoke_lease(kv.lease, deadline=deadline)
                else:
                    run.client.delete(run.keys.node(node))
                found = True
                logger.warning("node %s is gone (%s); revoked its lease (its record and any "
                               "leadership go)", node, why)
        return found

    def _probe_unanswered(self, address: tuple[str, int]) -> bool:
        """Probes one peer's liveness port again: True if it refuses or answers nothing."""
        refused, unanswered = self._probes.recheck([address])
        return address in refused or address in unanswered

    def _check_silent_peers(self, epoch: int) -> bool:
        """:class:`SilentPeerWatch`'s check: removes the peers of world ``epoch`` that went
        silent; whether to stop checking (one went, or the world moved on)."""
        world = self._run.world() if self._run is not None else None
        if world is None or world.epoch != epoch:
            return True
        peers = watched_peers([m.node for m in world.members], self._node)
        return self._check_suspects(peers, world, silent=True)

    def _push_world(self) -> None:
        """Passes the newest world to the workers (called on every control-key change)."""
        run = self._run
        if run is None:
            return
        world = run.world()
        end = run.view.end()
        if end is not None:
            self._channel.broadcast(End(end.outcome, end.reason, end.step))
        elif world is not None:
            self._channel.broadcast(World(world))
        self._wake.set()

    # -- the main loop ----------------------------------------------------------------------

    def request_departure(self, notice: Any) -> None:
        """Leave the job on ``notice`` (any thread; the main loop does the work, once)."""
        if self._departure is None:
            self._departure = notice
            self._wake.set()

    def request_stop(self, signum: int) -> None:
        """Stop on a signal (SIGTERM, SIGINT): the workers get it too and drain (a final
        checkpoint, agreed by every rank), then this node leaves. Signal-safe: it only sets a
        flag the main loop acts on."""
        if self._stop_signal is None:
            self._stop_signal = signum
            self._wake.set()
    def run(self) -> AgentOutcome:
        """Runs this node's part of the job; returns how it ended."""
        keys = JobKeys(self.config.key_prefix, self.config.job_id)
        opened = open_run(self.client, keys, linger=self.config.linger)
        if opened.ended is not None:
            return self._late(opened.ended)
        self._run = RunMembership(
            self.client, opened.keys,
            limits=RunLimits(self.config.min_nodes, self.config.max_nodes,
                             self.config.last_call, rebuild_after=self.config.build_timeout),
            ttl=self.config.ttl, linger=self.config.linger, on_change=self._push_world,
            on_lease_lost=self._lease_lost.set)
        self._start_slots_for_join()
        self._run.join(self._record())
        self.events.record("agent_started", node_id=self._node,
                           generation=opened.keys.generation,
                           min_nodes=self.config.min_nodes, max_nodes=self.config.max_nodes,
                           nproc_per_node=self.config.nproc_per_node,
                           max_restarts=self._budget.max_restarts,
                           preemption_watch=self.preemption_watch,
                           launched_at=self.launched_at)
        try:
            while True:
                outcome = self._tick()
                if outcome is not None:
                    return outcome
                self._wake.wait(self.config.monitor_interval)
                self._wake.clear()
        finally:
            self._shutdown()

    def _late(self, end: EndRecord) -> AgentOutcome:
        if end.outcome == "finished":
            return AgentOutcome(0, "already_finished",
                                f"job {self.config.job_id} already finished ({end.reason}); "
                                "this node has nothing to do.")
        return AgentOutcome(1, "failed", f"job {self.config.job_id} failed: {end.reason}")

    def _tick(self) -> AgentOutcome | None:
        run = self._run
        assert run is not None
        if run.view.watch.failed.is_set() or self._reconnect is not None:
            outcome = self._while_cut_off(run)
            if outcome is not None:
                return outcome
        end = run.view.end()
        if end is not None:
            return self._finish(end)
        self._check_lease(run)
        if self._lease_lost.is_set():
            return None
        outcome = self._stop_if_signalled()
        if outcome is not None:
            return outcome
        self._reap()
        if self._exhausted:
            return AgentOutcome(
                1, "budget_exhausted",
                f"this node's workers crashed {self._budget.recent()} times within "
                f"{self._budget.window:g} s (--max-restarts {self._budget.max_restarts}); it "
                "left the job, which goes on with the other nodes.")
        self._check_heartbeats()
        self._follow_world(run)
        outcome = self._depart_if_done()
        if outcome is not None:
            return outcome
        self._start_due()
        if all(slot.finished for slot in self._slots) and not self._said_done:
            self._said_done = True
            logger.info("this node's workers finished training; waiting for the rest of the "
                        "job")
        return self._check_join_timeout(run)

    # -- membership -------------------------------------------------------------------------

    def _while_cut_off(self, run: RunMembership) -> AgentOutcome | None:
        """etcd could not be watched for the etcd deadline: stop on a job-wide outage, or
        ride out a cut (see :mod:`membership.cutoff`); returns the outcome if the run ended
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
            lease = run.node.lease
            refreshed = lease.last_refreshed if lease is not None else None
            answering = None
            if self._progress_at is None or refreshed is None:
                world = run.world()
                answering = peers_answer([(m.addr, m.probe_port) for m in (
                    world.members if world is not None else ())
                    if m.node != self._node and m.probe_port])
            if not cut_off(self._progress_at, refreshed, self.config.ttl, answering):
                error = run.view.watch.error
                raise error if error is not None else EtcdUnavailableError("etcd watch failed")
            logger.warning(
                "etcd (%s) has not answered for the etcd deadline, and %s: this node is cut "
                "off from the job, not witnessing an etcd outage; it keeps trying to reach "
                "etcd for up to %.0f s (join_timeout)", run.client.endpoints_text,
                "no other node answers" if answering is False else "this node's workers "
                "stopped training when the others must have dropped it",
                self.config.join_timeout)
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
            return None  # the run's end record is still there: _tick finishes with it
        ended = ended_while_away(reconnect.generation, run.keys.generation)
        if ended is None:
            return None  # the run goes on: a lost lease makes this node join again
        code, outcome, message = ended
        logger.warning("%s", message)
        return AgentOutcome(code, outcome, message)

    def _check_lease(self, run: RunMembership) -> None:
        """Tells the workers whether they may commit, and rejoins after a confirmed loss.

        A lease not refreshed for a while (etcd unreachable) only stops checkpoint commits: it
        is not lost yet (etcd renews every lease when it comes back from an outage), and if
        the others did drop this node, their new world severed its connections, so its
        workers cannot train on in the old one. Only when etcd confirms the lease is gone are
        the workers stopped and the node joins again under a new id.
        """
        fresh = run.node.fresh()
        if fresh != self._pushed_lease_ok:
            self._pushed_lease_ok = fresh
            self._channel.broadcast(Lease(fresh))
        if not self._lease_lost.is_set():
            return
        if any(s.process is not None and s.process.exit_code() is None for s in self._slots):
            logger.warning("etcd dropped this node from the run: stopping its workers; it "
                           "joins again as a new node")
            self.events.record("lease_lost", node=self._node)
            self._kill_all()
        with contextlib.suppress(Exception):  # the lease is gone anyway
            run.node.leave()
        self._node = new_node_id()
        with self._lock:
            for slot in self._slots:
                self._next_incarnation(slot)
        self._start_slots_for_join()
        try:
            run.rejoin(self._record())
        except EtcdUnavailableError:
            time.sleep(_RETRY_REJOIN_S)
            return
        self._lease_lost.clear()
        self._no_world_since = time.monotonic()
        logger.info("joined again as node %s", self._node)

    def _follow_world(self, run: RunMembership) -> None:
        world = run.world()
        if world is None or (self._last_world is not None
                             and world.revision == self._last_world.revision):
            return
        previous, self._last_world = self._last_world, world
        # Learn which peers answer a liveness probe, so that their refusal is trusted later.
        self._probes.learn_in_background(
            (m.addr, m.probe_port) for m in world.members
            if m.node != self._node and m.probe_port)
        if world.store[0] == self.config.addr and self._stores.claim(world.store[1],
                                                                     world.epoch):
            self._publish()
        cause = _cause_of(world, previous)
        if cause is not None:
            self._change_reason = cause
        mine = world.member(self._node)
        if mine is not None:
            self._no_world_since = time.monotonic()
            if previous is None or previous.epoch != world.epoch:
                self.epochs.append(world.epoch)
                self.events.record("round_started", round=world.epoch,
                                   group_rank=world.node_rank(self._node),
                                   world=len(world.members), workers=world.world_size,
                                   mode=world.mode, reason=self._change_reason)
                self._change_reason = "node_joined"
        if self._clear_stale_waiting(world):
            self._publish()
        with self._lock:
            for slot in self._slots:
                wid = worker_id(self._node, slot.local_id)
                if wid in world.evicted and slot.process is not None:
                    logger.warning("worker %s was evicted (every other worker waited for "
                                   "it): replacing it", slot.local_id)
                    self.events.record("worker_evicted", round=world.epoch,
                                       local_rank=slot.local_rank)
                    slot.process.kill()
            if world.mode == "inplace":
                return
            self._restart_mode_follow(world)

    def _clear_stale_waiting(self, world: WorldRecord) -> bool:
        changed = False
        with self._lock:
            for slot in self._slots:
                if slot.waiting is not None and slot.waiting["epoch"] != world.epoch:
                    slot.waiting = None
                    changed = True
        return changed

    def _restart_mode_follow(self, world: WorldRecord) -> None:
        """Restart mode: start workers for a world that includes them, restart on change."""
        mine = world.member(self._node)
        ids = set(mine.workers) if mine is not None else set()
        running = [s for s in self._slots if s.process is not None
                   and s.process.exit_code() is None]
        # The empty world restarts every running worker (the leader then forms the next
        # world from fresh incarnations only), a joiner started for no world included.
        stale = [s for s in running if (s.started_for is None and not world.members) or (
            s.started_for is not None and not s.started_for.same_composition(world))]
        if stale and not self._departure:
            logger.info("world epoch %d differs from the one this node's workers run in "
                        "(epoch %d): restarting them", world.epoch,
                        stale[0].started_for.epoch if stale[0].started_for else -1)
            self.events.record("workers_restarted", round=world.epoch, reason="world_changed")
            stop_all([s.process for s in stale if s.process is not None],
                     self.config.shutdown_grace)
            for slot in stale:
                report = slot.report or {}
                if report.get("before_stop") and report.get("error"):
                    # It was dying of its own error when the restart came: that error
                    # still counts (every worker dying of it ends the job at once).
                    self._note_failure(report)
                    logger.warning("worker %s failed (%s) as this node restarted its "
                                   "workers", slot.local_id, report.get("error"))
                slot.process = None
                self._next_incarnation(slot)
                slot.ready = True  # agent-ready: started when a world includes it
            self._publish()
            return
        started = False
        for slot in self._slots:
            if (slot.process is None and slot.ready and slot.restart_at is None
                    and slot.pending is None and slot.local_id in ids and not slot.finished):
                self._start(slot, world)
                started = True
        if started:
            self._publish()  # shows them running: after an empty world, no world takes them

    def _check_join_timeout(self, run: RunMembership) -> AgentOutcome | None:
        world = run.world()
        if world is not None and world.member(self._node) is not None:
            return None
        waited = time.monotonic() - self._no_world_since
        if waited < self.config.join_timeout:
            return None
        return AgentOutcome(
            3, "rendezvous_error",
            f"this node found no world to train in for {waited:.0f} s (fewer than "
            f"--min-nodes ({self.config.min_nodes}) nodes could train); check that the other "
            "nodes are running, or lower --min-nodes.")

    # -- workers ----------------------------------------------------------------------------

    def _next_incarnation(self, slot: _Slot) -> None:
        slot.incarnation += 1
        slot.ready = False
        slot.inplace = False
        slot.report = None
        slot.waiting = None
        slot.started_for = None

    def _start_slots_for_join(self) -> None:
        """Sets the slots up for joining the run (at start, or again after a lost lease).

        Joining a world that reconfigures in place, the workers start at once as joiners:
        they turn ready when their training loop starts, so the survivors keep training while
        they build their models (an empty in-place world too: its survivors wait, with the
        job's state, for enough nodes). Otherwise the slots are published ready and the
        workers start once a world includes them (their ranks must be known at start).
        """
        run = self._run
        world = run.world() if run is not None else None
        with self._lock:
            for slot in self._slots:
                if slot.process is not None or slot.finished:
                    continue
                if slot.incarnation == 0:
                    slot.incarnation = 1
                if world is not None and world.mode == "inplace":
                    self._start(slot, None)
                else:
                    slot.ready = True

    def _env_for(self, slot: _Slot, world: WorldRecord | None) -> dict[str, str]:
        config = self.config
        local_id = slot.local_id
        values = {
            "LOCAL_RANK": str(slot.local_rank),
            "TORCHELASTIC_RUN_ID": config.job_id,
            "TORCHELASTIC_MAX_RESTARTS": str(self._budget.max_restarts),
            "TORCHELASTIC_RESTART_COUNT": str(self._budget.total),
            env.RUN_ID: config.job_id,
            env.AGENT_PID: str(os.getpid()),
            env.AGENT_SOCKET: self._channel.path,
            env.INCARNATION: str(slot.incarnation),
            env.WORKER_ID: worker_id(self._node, local_id),
            env.MODE: config.mode,
            **config.worker_env,
        }
        if config.nproc_per_node > 1:
            values.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        if world is not None and (mine := world.member(self._node)) is not None:
            offset = world.rank_offset(self._node)
            position = mine.workers.index(local_id)
            values.update({
                "RANK": str(offset + position), "WORLD_SIZE": str(world.world_size),
                "LOCAL_WORLD_SIZE": str(len(mine.workers)),
                "GROUP_RANK": str(world.node_rank(self._node)),
                "GROUP_WORLD_SIZE": str(len(world.members)),
                "ROLE_RANK": str(offset + position), "ROLE_WORLD_SIZE": str(world.world_size),
                "ROLE_NAME": "default",
                "MASTER_ADDR": world.store[0], "MASTER_PORT": str(world.store[1]),
                # The world's store is a fresh server hosted by an agent: every rank is a
                # client (torch's env:// rendezvous then adds no prefix, and none is needed).
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                env.ROUND: str(world.epoch), env.START: "member",
            })
        else:
            # A joiner of a running world: provisional values until it is admitted.
            running = self._run.world() if self._run is not None else None
            size = running.world_size if running is not None else 1
            values.update({
                "RANK": str(max(0, size - 1)), "WORLD_SIZE": str(max(1, size)),
                "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
                "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                env.ROUND: str(running.epoch if running is not None else 0),
                env.START: "joiner",
            })
        return values

    def _start(self, slot: _Slot, world: WorldRecord | None) -> None:
        if self._stop_signal is not None or self._departure is not None:
            return  # leaving: no new worker
        env_vars = self._env_for(slot, world)
        slot.process = SlotProcess.start(self.command, slot.local_rank, slot.incarnation,
                                         env_vars)
        slot.started_for = world
        slot.restart_at = None
        slot.finished = False
        # elastic_run_worker_restarts_total counts the starts after a slot's first.
        self.events.record("workers_started", round=world.epoch if world else self._epoch(),
                           workers=1, restart=slot.incarnation > 1)

    def _reap(self) -> None:
        changed = False
        exhausted = False
        now = time.monotonic()
        with self._lock:
            for slot in self._slots:
                process = slot.process
                code = process.exit_code() if process is not None else None
                if process is not None and code is not None:
                    slot.process = None
                    changed = True
                    if code == 0:
                        slot.finished = True
                        logger.info("worker %s exited 0", slot.local_id)
                        continue
                    slot.pending = _Failure(process, code, slot.started_for or
                                            self._last_world, now + self._settle_s(),
                                            lease_fresh=self._lease_fresh())
                    slot.ready = False  # gone: the leader takes it out of the world now
                if slot.pending is not None and not self._settle(slot, now):
                    exhausted = True
        if exhausted:
            self._leave_exhausted()
        elif changed:
            self._publish()

    def _settle_s(self) -> float:
        """How long a failure may wait for evidence that a peer caused it: a crashed
        worker's agent reports it at once, a dead node is found by its refusing liveness
        port at once, a silent host takes its lease TTL."""
        return self.config.ttl + 1.0

    def _peer_evidence(self, failure: _Failure) -> bool:
        """Whether a newer world names, as lost, a worker of another node that was in the
        failed worker's world, or another node of that world is dead (its agent's liveness
        port refuses): the failure was that peer's, not this worker's."""
        before = failure.world
        if failure.peer_node_dead:
            return True
        newest = self._run.world() if self._run is not None else None
        if before is None or newest is None or newest.epoch <= before.epoch:
            return False
        others = {w for w in before.ranks() if not w.startswith(self._node + "/")}
        return bool(others & (set(newest.lost) | set(newest.evicted)))

    def _lease_fresh(self) -> bool:
        """Whether etcd may still hold this node's lease: refreshed within its TTL. A worker
        whose peers moved on without this node failed later than that (etcd drops a lease a
        TTL after its last refresh, and only then do the others move on); the margin keeps a
        refresh delayed by a busy machine from passing a crash off as a partition. (The
        commit fence is stricter: half the TTL.)"""
        run = self._run
        lease = run.node.lease if run is not None else None
        return lease is None or lease.fresh(margin=1.0)

    def _settle(self, slot: _Slot, now: float) -> bool:
        """Decides a pending failure once its cause is known; False if the budget is out.

        A worker that failed while this node's lease had not been refreshed for its TTL (cut
        off from etcd, or already dropped by it) lost its peers to the partition: the others
        moved on without this node and severed their connections, and nobody here can learn
        of it. That is not the script's crash, so it is never charged to the crash budget: a
        long cut must not turn into exit 1 (the node joins again once etcd answers).
        """
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
        certain = (failure.process.stopping or bool(report.get("peer"))
                   or bool(report.get("drained")) or partitioned or own)
        if not certain and not self._peer_evidence(failure) and now < failure.decide_by:
            if not failure.probed:
                # A dead node's lease outlives it by up to the TTL, and the world written
                # meanwhile may name only this node's worker: ask its peers directly.
                failure.probed = True
                threading.Thread(target=self._probe_peers, args=(failure,), daemon=True,
                                 name="elastic-probe-peers").start()
            return True  # the cause is not settled yet: wait for membership to say
        slot.pending = None
        if not failure.process.stopping and not own and self._peer_evidence(failure):
            report = {**report, "peer": True}
            slot.report = report
        elif not failure.process.stopping and partitioned:
            report = {**report, "partition": True}
            slot.report = report
        return self._handle_failure(slot, failure.process, failure.code)

    def _probe_peers(self, failure: _Failure) -> None:
        """Marks ``failure`` a peer's if another node of its world is dead (and drops that
        node's record, as a worker's suspicion would)."""
        world = failure.world
        if world is None:
            return
        others = [m.node for m in world.members if m.node != self._node]
        if self._check_suspects(others, world):
            failure.peer_node_dead = True
            self._wake.set()

    def _still_connected(self, process: SlotProcess) -> bool:
        """Whether the channel still has an open connection from ``process``."""
        connection = self._channel.connection(process.local_rank)
        return connection is not None and connection.pid == process.pid

    def _handle_failure(self, slot: _Slot, process: SlotProcess, code: int) -> bool:
        """Decides what a failed worker costs; returns False if the budget is exhausted."""
        report = slot.report or {}
        # The newest world, not the last one followed: a mode upgrade (every worker now in
        # place) may have landed in this very tick.
        newest = self._run.world() if self._run is not None else None
        world = newest if newest is not None else self._last_world
        in_place = world is not None and world.mode == "inplace" and slot.inplace
        if report.get("drained") or (process.stopping and not report.get("before_stop")):
            cause, delay = "stopped", 0.0
        elif report.get("peer"):
            cause, delay = "peer_failure", self._budget.backoff_base
        elif report.get("partition"):
            cause, delay = "partition", self._budget.backoff_base
        else:
            cause = "crash"
            charged = self._budget.charge()
            if charged is None:
                self._note_failure(report)
                self.events.record("worker_failed", round=world.epoch if world else -1,
                                   exit_codes={slot.local_rank: code}, cause="crash",
                                   budget_exhausted=True)
                return False
            delay = charged
            self._restarts += 1
        if cause != "stopped":
            self._note_failure(report, own=cause == "crash")
            logger.warning("worker %s failed (exit code %s, %s: %s); restarting %s in %.1f s",
                           slot.local_id, code, cause, report.get("error", "no report"),
                           "it in place" if in_place else "this node's workers", delay)
            self.events.record("worker_failed", round=world.epoch if world else -1,
                               exit_codes={slot.local_rank: code}, cause=cause,
                               error=report.get("error"))
            self._channel.broadcast(Gone((worker_id(self._node, slot.local_id),)))
        now = time.monotonic()
        if in_place:
            self._next_incarnation(slot)
            slot.restart_at = now + delay
            return True
        # Restart mode: the node's other workers are in a broken world too.
        others = [s for s in self._slots if s is not slot and s.process is not None]
        stop_all([s.process for s in others if s.process is not None],
                 self.config.shutdown_grace)
        for each in self._slots:
            each.process = None
            self._next_incarnation(each)
            each.restart_at = now + delay
        return True

    def _note_failure(self, report: Mapping[str, Any], *, own: bool = True) -> None:
        """Keeps the last error this node's workers died of for the leader's "script bug"
        rule (:func:`~membership.proposal.common_failure`). ``own`` is False for a worker
        that died of a peer's failure: survivors of one dead peer all report the same error
        text (naming that peer), which alone is no evidence of a bug in the script."""
        error = report.get("error")
        if not error:
            return
        step = int(report.get("step", -1))
        note = self._failure_note
        if note is not None and note.get("error") == error and note.get("step") == step:
            self._failure_note = {**note, "count": int(note.get("count", 1)) + 1,
                                  "own": bool(note.get("own", True)) or own}
        else:
            self._failure_note = {"step": step, "error": str(error), "count": 1, "own": own}

    def _start_due(self) -> None:
        """Starts (in place) or re-publishes (restart mode) slots whose backoff is over."""
        now = time.monotonic()
        changed = False
        world = self._last_world
        with self._lock:
            if self._departure is not None:
                return
            for slot in self._slots:
                if slot.restart_at is None or slot.restart_at > now or slot.process is not None:
                    continue
                slot.restart_at = None
                changed = True
                # An empty in-place world too: its survivors wait for enough nodes, with
                # the state a joiner heals from (a restart-mode start would restart them).
                if world is not None and world.mode == "inplace":
                    self._start(slot, None)
                    self.events.record("workers_restarted_in_place", round=world.epoch,
                                       local_rank=slot.local_rank)
                else:
                    slot.ready = True
        if changed:
            self._publish()

    def _check_heartbeats(self) -> None:
        """Replaces workers that fell silent (stopped, frozen) for longer than the TTL.

        A worker whose interpreter is shutting down (it said so) gets the shutdown grace
        instead: its heartbeat thread is gone while torch's teardown runs, seconds on a busy
        host, and killing it then would turn a clean exit into a failure.
        """
        now = time.monotonic()
        for connection in self._channel.connections():
            limit = self.config.shutdown_grace if connection.exiting else self.config.ttl
            if now - connection.last_heard <= limit:
                continue
            with self._lock:
                slot = self._slot_of(connection)
                if slot is None or slot.process is None or slot.process.stopping:
                    continue
                logger.warning("worker %s sent no heartbeat for %.1f s: replacing it",
                               slot.local_id, now - connection.last_heard)
                self.events.record("worker_silent", local_rank=slot.local_rank,
                                   silent_s=round(now - connection.last_heard, 2))
                slot.process.kill()
            connection.close()

    def _kill_all(self) -> None:
        with self._lock:
            processes = [s.process for s in self._slots if s.process is not None]
        for process in processes:
            process.kill()
        stop_all(processes, 0.0)
        with self._lock:
            for slot in self._slots:
                slot.process = None

    # -- leaving ----------------------------------------------------------------------------

    def _depart_if_done(self) -> AgentOutcome | None:
        """Runs a planned departure: announce, let the workers leave, then go."""
        notice = self._departure
        if notice is None:
            return None
        run = self._run
        assert run is not None
        now = time.monotonic()
        world = self._last_world
        in_place = world is not None and world.mode == "inplace"
        if self._departing_since is None:
            self._departing_since = now
            logger.warning("preemption notice from %s: leaving the job",
                           getattr(notice, "source", "?"))
            self.events.record("planned_departure", round=self._epoch(),
                               notice=getattr(notice, "source", "?"), in_place=in_place,
                               announced=True, member_ttl=self.config.ttl,
                               deadline=(self._departure_note() or {}).get("deadline"))
            # The departing note. In place the leader writes a world without this node at
            # once, marked departed: its workers leave at the next step boundary, nobody
            # restarts. In restart mode the world stays until the drain is over (a final
            # checkpoint needs every rank), then goes as planned.
            self._publish()
            if not in_place:
                with self._lock:
                    for slot in self._slots:
                        if slot.process is not None:
                            slot.process.terminate()
        budget = min(self.config.drain_timeout, _notice_budget(notice))
        running = [s for s in self._slots if s.process is not None
                   and s.process.exit_code() is None]
        if running and now - self._departing_since < budget:
            return None
        if running:
            stop_all([s.process for s in running if s.process is not None], 0.0)
        self.events.record("left_rendezvous", round=self._epoch(), drained=not running,
                           drain_s=round(now - self._departing_since, 3))
        return AgentOutcome(0, "departed", f"left the job on a "
                            f"{getattr(notice, 'source', 'preemption')} notice.")

    def _stop_if_signalled(self) -> AgentOutcome | None:
        """Passes a stop signal on to the workers, waits for them (up to the shutdown grace),
        then ends this node's part with ``128 + signal`` (as torchrun does)."""
        signum = self._stop_signal
        if signum is None:
            return None
        now = time.monotonic()
        with self._lock:
            running = [s.process for s in self._slots
                       if s.process is not None and s.process.exit_code() is None]
            if self._stop_since is None:
                self._stop_since = now
                logger.warning("signal %d: stopping this node's workers (they drain at the "
                               "next step boundary) and leaving the job", signum)
                for process in running:
                    process.terminate()
        if running and now - self._stop_since < self.config.shutdown_grace:
            return None
        if running:
            stop_all(running, 0.0)
        return AgentOutcome(128 + signum, "signal",
                            f"stopped by signal {signum} (workers "
                            f"{'killed' if running else 'drained'}).")

    def _leave_exhausted(self) -> None:
        self._kill_all()
        self._exhausted = True
        self._wake.set()

    def _epoch(self) -> int:
        return self._last_world.epoch if self._last_world is not None else -1

    def _end(self, end: EndRecord) -> None:
        run = self._run
        if run is None:
            return
        try:
            run.end(end)
        except EtcdUnavailableError as exc:
            logger.warning("could not record the end of the run (%s)", exc)

    def _finish(self, end: EndRecord) -> AgentOutcome:
        """The run ended: let finishing workers exit, stop the rest, report the outcome."""
        deadline = time.monotonic() + (_FINISH_GRACE_S if end.outcome == "finished" else 0.0)
        while time.monotonic() < deadline and any(
                s.process is not None and s.process.exit_code() is None for s in self._slots):
            time.sleep(0.05)
        with self._lock:
            processes = [s.process for s in self._slots if s.process is not None]
        stop_all(processes, 0.0 if end.outcome == "failed" else 5.0)
        if end.outcome == "finished":
            self.events.record("job_finished", round=self._epoch())
            return AgentOutcome(0, "succeeded", f"job {self.config.job_id} finished.")
        return AgentOutcome(1, "failed", f"job {self.config.job_id} failed: {end.reason}")

    def _shutdown(self) -> None:
        self._kill_all()
        if self._reconnect is not None:
            self._reconnect.stop()
        run = self._run
        if run is not None:
            with contextlib.suppress(Exception):
                run.leave()
        self._silent_peers.close()
        self._channel.close()
        self._liveness.close()
        self._stores.close()


def _etcd_answers(run: RunMembership) -> bool:
    """Whether etcd answers right now (one quick status call, about 2 s at most)."""
    try:
        run.client.status(deadline=timedelta(seconds=2))
    except EtcdUnavailableError:
        return False
    return True


def _cause_of(world: WorldRecord, previous: WorldRecord | None) -> str | None:
    """Why ``world`` was written, for the event log (``None``: it says nothing new)."""
    if previous is not None and world.epoch == previous.epoch:
        return None  # a mode upgrade of the same world
    return world.cause or None


def _notice_budget(notice: Any) -> float:
    """Seconds left before the notice's deadline (a few kept to leave), or no limit."""
    left = getattr(notice, "time_left", None)
    remaining = left() if callable(left) else None
    if isinstance(remaining, timedelta):
        return max(0.0, remaining.total_seconds() - 5.0)
    return float("inf")

