"""Supervising a node's worker slots: starting, watching and stopping their processes.

One part of the node agent (``docs/agent.md`` has the map). It owns the slots
(:class:`~launch.slot_state.Slot`) and their processes (:mod:`launch.slots`), and touches
nothing else: no etcd, no crash budget (the failure judge decides what an exit costs and calls
:meth:`Supervisor.restart_in_place` or :meth:`Supervisor.restart_all`), no world record it
did not receive as an argument.

* In place a slot's worker is started at once (a joiner: it is admitted to the running world
  when its training loop starts); in restart mode it is published ready and started once a
  world names it (its rank must be known at start), and restarted when the world changes.
* A worker that falls silent is replaced, not charged: one the kernel reports stopped
  (SIGSTOP) once it has been silent for :data:`FROZEN_AFTER_S`, any other after the lease TTL
  (a heartbeat thread starved by a busy host, a long garbage-collection pause, or a step ten
  times the median are running processes, never stopped ones, so they get the TTL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from elastic.contract.messages import BuildFailed, Declare, Exiting, Ready, Waiting
from elastic.contract.records import WorkerSlot, WorldRecord, worker_id
from elastic.eventlog import EventLog
from launch.agent_config import AgentConfig
from launch.channel import WorkerConnection
from launch.slot_state import Slot
from launch.slots import SlotProcess, WorkerCommand, stop_all
from launch.standby import StandbyPool
from launch.worker_env import worker_env

__all__ = ["FROZEN_AFTER_S", "Supervisor"]

logger = logging.getLogger(__name__)

#: A worker silent this long whose process the kernel reports stopped is replaced (its
#: heartbeat comes every 0.5 s; a stop shorter than this is forgiven).
FROZEN_AFTER_S: Final = 0.6

#: After a worker's hello, how long its slot's next standby waits for the worker to declare
#: that it reconfigures in place (which drops the standbys).
STANDBY_HOLD_AFTER_HELLO_S: Final = 10.0


class Supervisor:
    """The node's worker slots and their processes.

    Args:
        config: The agent's settings.
        command: What every worker runs.
        events: The job event log.
        node: This node's id.
        channel_path: The workers' channel socket.
        may_start: Whether new workers may start now (not while the node leaves).
    """

    def __init__(self, config: AgentConfig, command: WorkerCommand, events: EventLog, *,
                 node: Callable[[], str], channel_path: Callable[[], str],
                 may_start: Callable[[], bool]) -> None:
        self.config = config
        self.command = command
        self.events = events
        self._node = node
        self._channel_path = channel_path
        self._may_start = may_start
        #: Guards the slots: the channel's threads and the main loop both change them.
        self.lock = threading.RLock()
        self.slots = [Slot(i) for i in range(config.nproc_per_node)]
        #: The most workers one world may have, as the workers declared it (their batch).
        self.max_world: int | None = None
        #: The newest world epoch a worker of this node could not build.
        self.failed_build: int | None = None
        #: Warm standby interpreters that workers start in (launch/standby.py): a restart
        #: skips interpreter start-up and torch's imports.
        self.standby = (StandbyPool(command.argv[0], config.nproc_per_node, self._standby_env)
                        if config.warm_standby and StandbyPool.supports(command.argv)
                        else None)

    # -- views ------------------------------------------------------------------------------

    def is_worker(self, pid: int) -> bool:
        """Whether ``pid`` is one of this node's workers (or a descendant of one)."""
        with self.lock:
            roots = {s.process.pid for s in self.slots if s.process is not None}
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

    def slot_of(self, connection: WorkerConnection) -> Slot | None:
        """The slot a channel connection belongs to (``None``: an older incarnation)."""
        if not 0 <= connection.local_rank < len(self.slots):
            return None
        slot = self.slots[connection.local_rank]
        return slot if slot.incarnation == connection.incarnation else None

    def published(self) -> tuple[WorkerSlot, ...]:
        """The slots as the node record shows them."""
        with self.lock:
            return tuple(s.published() for s in self.slots)

    def running(self) -> list[SlotProcess]:
        """The processes that have not exited."""
        with self.lock:
            return [s.process for s in self.slots
                    if s.process is not None and s.process.exit_code() is None]

    def all_finished(self) -> bool:
        """Every slot's worker exited 0."""
        return all(s.finished for s in self.slots)

    def waiting_note(self) -> dict[str, object] | None:
        """``{"epoch", "step", "workers"}`` of the workers waiting past the hang threshold
        (the progress rule reads it from the node record), or ``None``."""
        notes = [(s.waiting, s.local_id) for s in self.slots if s.waiting is not None]
        if not notes:
            return None
        epoch = max(int(n["epoch"]) for n, _ in notes)
        step = max(int(n["step"]) for n, _ in notes if int(n["epoch"]) == epoch)
        workers = [lid for n, lid in notes
                   if int(n["epoch"]) == epoch and int(n["step"]) == step]
        return {"epoch": epoch, "step": step, "workers": sorted(workers)}

    def clear_stale_waiting(self, world: WorldRecord) -> bool:
        """Forgets waits in other worlds than ``world``; returns whether any went."""
        changed = False
        with self.lock:
            for slot in self.slots:
                if slot.waiting is not None and slot.waiting["epoch"] != world.epoch:
                    slot.waiting = None
                    changed = True
        return changed

    # -- what workers say (each returns whether the node record changes) --------------------

    def on_exiting(self, connection: WorkerConnection, slot: Slot, _: Exiting) -> bool:
        """Its interpreter shuts down: it gets the shutdown grace, not the heartbeat rule."""
        connection.exiting = True
        return False

    def on_ready(self, _: WorkerConnection, slot: Slot, message: Ready) -> bool:
        """Its training loop started: it may be placed in a world."""
        slot.ready, slot.inplace = True, message.inplace
        if message.max_world is not None:
            self.max_world = message.max_world
        return True

    def on_declare(self, _: WorkerConnection, slot: Slot, message: Declare) -> bool:
        """It reconfigures in place (before it is ready)."""
        slot.inplace = message.inplace
        if message.max_world is not None:
            self.max_world = message.max_world
        return True

    def on_waiting(self, _: WorkerConnection, slot: Slot, message: Waiting) -> bool:
        """It waits past the hang threshold (the progress rule reads the record)."""
        slot.waiting = {"epoch": message.epoch, "step": message.step}
        return True

    def on_resumed(self, slot: Slot) -> bool:
        """The step it waited in completed."""
        was_waiting, slot.waiting = slot.waiting is not None, None
        return was_waiting

    def on_build_failed(self, _: WorkerConnection, slot: Slot, message: BuildFailed) -> bool:
        """It could not build a world's groups (the leader writes the world again)."""
        if self.failed_build is None or message.epoch > self.failed_build:
            self.failed_build = message.epoch
            return True
        return False

    # -- starting ---------------------------------------------------------------------------

    def prepare_join(self, world: WorldRecord | None) -> None:
        """Sets the slots up for joining the run at start (see the module docstring): in an
        in-place world (an empty one too: its survivors wait, with the job's state, for
        enough nodes) the workers start at once as joiners."""
        with self.lock:
            for slot in self.slots:
                if slot.process is not None or slot.finished:
                    continue
                if slot.incarnation == 0:
                    slot.incarnation = 1
                if world is not None and world.mode == "inplace":
                    self.start(slot, None, world)
                else:
                    slot.ready = True

    def start(self, slot: Slot, world: WorldRecord | None, running: WorldRecord | None
              ) -> None:
        """Starts ``slot``'s worker for ``world`` (``None``: a joiner of ``running``)."""
        if not self._may_start():
            return  # leaving: no new worker
        environment = worker_env(self.config, slot, node=self._node(),
                                 channel_path=self._channel_path(), world=world,
                                 running=running)
        slot.process = SlotProcess.start(self.command, slot.local_rank, slot.incarnation,
                                         environment, standby=self.standby)
        slot.started_for = world
        slot.restart_at = None
        slot.finished = False
        # elastic_run_worker_restarts_total counts the starts after a slot's first.
        epoch = world.epoch if world else (running.epoch if running else -1)
        self.events.record("workers_started", round=epoch, workers=1,
                           restart=slot.incarnation > 1, warm=slot.process.warm)

    def _standby_env(self, local_rank: int) -> dict[str, str]:
        """What a worker of ``local_rank`` would start with now, for its standby (the pool
        drops the world's variables)."""
        with self.lock:
            slot = self.slots[local_rank]
            return {**self.command.base_env,
                    **worker_env(self.config, slot, node=self._node(),
                                 channel_path=self._channel_path(), world=None, running=None)}

    def tick_standbys(self) -> None:
        """Replaces standbys that died and starts those that are due (the main loop); drops
        them for good once this node's workers declared that they reconfigure in place,
        unless ``standby_in_place``."""
        if self.standby is None:
            return
        keep_in_place = self.config.standby_in_place
        if not keep_in_place and any(s.inplace for s in self.slots):
            # In place only a crashed worker restarts, and the survivors train on without
            # waiting for it: a standby would hold its memory, and spend its imports' CPU
            # beside the training after every replacement, for nothing the survivors feel.
            self.standby.close()
            self.standby = None
            logger.info("this node's workers reconfigure in place: no warm standbys kept "
                        "(--warm-standby on keeps them)")
            return
        self.standby.tick(hold=() if keep_in_place else self._may_declare_in_place())

    def _may_declare_in_place(self) -> list[int]:
        """The slots whose worker said hello within ``STANDBY_HOLD_AFTER_HELLO_S`` and has not
        declared in place: no refill of their standbys yet. An ``ElasticLoop`` script says
        hello at ``elastic.init()`` and declares when its loop is built, seconds later; a
        standby refilled meanwhile would import torch beside it only to be dropped then (one
        wasted interpreter per slot of every in-place node). Under ``--elastic-mode
        restart`` no worker reconfigures in place, and nothing is held."""
        if self.config.mode == "restart":
            return []
        now = time.monotonic()
        return [slot.local_rank for slot in self.slots
                if slot.process is not None and slot.process.exit_code() is None
                and not slot.inplace and slot.connected_at is not None
                and now - slot.connected_at < STANDBY_HOLD_AFTER_HELLO_S]

    def close_standbys(self) -> None:
        """Kills the standbys (the agent is leaving)."""
        if self.standby is not None:
            self.standby.close()

    def start_due(self, world: WorldRecord | None, newest: WorldRecord | None) -> bool:
        """Starts (in place) or re-publishes (restart mode) slots whose backoff is over;
        returns whether any changed.

        Args:
            world: The world this node follows (its mode decides).
            newest: The newest world (a joiner's provisional rank and size).
        """
        now = time.monotonic()
        changed = False
        with self.lock:
            if not self._may_start():
                return False
            for slot in self.slots:
                if slot.restart_at is None or slot.restart_at > now or slot.process is not None:
                    continue
                slot.restart_at = None
                changed = True
                # An empty in-place world too: its survivors wait for enough nodes, with
                # the state a joiner heals from (a restart-mode start would restart them).
                if world is not None and world.mode == "inplace":
                    self.start(slot, None, newest)
                    self.events.record("workers_restarted_in_place", round=world.epoch,
                                       local_rank=slot.local_rank)
                else:
                    slot.ready = True
        return changed

    def restart_in_place(self, slot: Slot, delay: float) -> None:
        """In place: ``slot`` alone restarts after ``delay`` (its node's others go on)."""
        slot.next_incarnation()
        slot.restart_at = time.monotonic() + delay

    def restart_all(self, except_for: Slot, delay: float) -> None:
        """Restart mode: the node's other workers are in a broken world too; every slot
        restarts after ``delay``."""
        others = [s.process for s in self.slots if s is not except_for and s.process is not None]
        stop_all(others, self.config.shutdown_grace)
        now = time.monotonic()
        for slot in self.slots:
            slot.process = None
            slot.next_incarnation()
            slot.restart_at = now + delay

    def follow_restart_mode(self, world: WorldRecord, leaving: bool,
                            dying: Callable[[Slot], None],
                            publish: Callable[[], None]) -> bool:
        """Restart mode: starts workers for a world that includes them, restarts them when
        the world changes; returns whether the slots changed (to publish).

        Args:
            world: The newest world.
            leaving: The node is leaving (its workers drain; none restarts).
            dying: Called for each slot stopped here whose worker had
                reported its own error before the stop (that error still counts).
            publish: Publishes the node record (the stopping slots as not ready).
        """
        node = self._node()
        mine = world.member(node)
        ids = set(mine.workers) if mine is not None else set()
        running = [s for s in self.slots if s.process is not None
                   and s.process.exit_code() is None]
        # The empty world restarts every running worker (the leader then forms the next
        # world from fresh incarnations only), a joiner started for no world included.
        stale = [s for s in running if (s.started_for is None and not world.members) or (
            s.started_for is not None and not s.started_for.same_composition(world))]
        if stale and not leaving:
            logger.info("world epoch %d differs from the one this node's workers run in "
                        "(epoch %d): restarting them", world.epoch,
                        stale[0].started_for.epoch if stale[0].started_for else -1)
            self.events.record("workers_restarted", round=world.epoch, reason="world_changed")
            # Unready while they stop (a drain can take seconds, and stop_all blocks the main
            # loop): the leader must not count the old incarnations as ready, or it forms
            # worlds without this node and grows them back with the stale ones, over and over.
            for slot in stale:
                slot.ready = False
            publish()
            stop_all([s.process for s in stale if s.process is not None],
                     self.config.shutdown_grace)
            for slot in stale:
                dying(slot)
                slot.process = None
                slot.next_incarnation()
                slot.ready = True  # agent-ready: started when a world includes it
            return True
        started = False
        for slot in self.slots:
            if (slot.process is None and slot.ready and slot.restart_at is None
                    and slot.pending is None and slot.local_id in ids and not slot.finished):
                self.start(slot, world, world)
                started = True
        return started  # publish: after an empty world, no world takes them

    # -- watching and stopping --------------------------------------------------------------

    def exits(self) -> tuple[list[tuple[Slot, SlotProcess, int]], bool]:
        """Reaps exited workers: a 0 marks the slot finished; the rest are returned (slot,
        process, exit code) for the failure judge, the slot no longer ready. Also returns
        whether any worker exited (the node record changes)."""
        failed = []
        exited = False
        with self.lock:
            for slot in self.slots:
                process = slot.process
                code = process.exit_code() if process is not None else None
                if process is None or code is None:
                    continue
                slot.process = None
                exited = True
                if code == 0:
                    slot.finished = True
                    logger.info("worker %s exited 0", slot.local_id)
                    continue
                slot.ready = False  # gone: the leader takes it out of the world now
                failed.append((slot, process, code))
        return failed, exited

    def check_heartbeats(self, connections: Sequence[WorkerConnection], ttl: float) -> None:
        """Replaces workers that fell silent (see the module docstring).

        A worker whose interpreter is shutting down (it said so) gets the shutdown grace
        instead: its heartbeat thread is gone while torch's teardown runs, seconds on a busy
        host, and killing it then would turn a clean exit into a failure.
        """
        now = time.monotonic()
        for connection in connections:
            silent = now - connection.last_heard
            limit = self.config.shutdown_grace if connection.exiting else ttl
            if silent <= min(limit, FROZEN_AFTER_S):
                continue
            with self.lock:
                slot = self.slot_of(connection)
                if slot is None or slot.process is None or slot.process.stopping:
                    continue
                frozen = not connection.exiting and slot.process.stopped()
                if silent <= limit and not frozen:
                    continue
                logger.warning("worker %s sent no heartbeat for %.1f s%s: replacing it",
                               slot.local_id, silent,
                               " and the kernel reports it stopped" if frozen else "")
                self.events.record("worker_silent", local_rank=slot.local_rank,
                                   silent_s=round(silent, 2), stopped=frozen)
                slot.process.kill()
            connection.close()

    def kill_evicted(self, world: WorldRecord) -> None:
        """Kills this node's workers that ``world`` evicted (every other worker waited for
        them); their slots restart like after a crash, uncharged."""
        node = self._node()
        with self.lock:
            for slot in self.slots:
                if worker_id(node, slot.local_id) in world.evicted and slot.process is not None:
                    logger.warning("worker %s was evicted (every other worker waited for "
                                   "it): replacing it", slot.local_id)
                    self.events.record("worker_evicted", round=world.epoch,
                                       local_rank=slot.local_rank)
                    slot.process.kill()

    def terminate_all(self) -> list[SlotProcess]:
        """SIGTERMs every running worker (they drain at a step boundary); returns them."""
        running = self.running()
        for process in running:
            process.terminate()
        return running

    def kill_all(self) -> None:
        """Kills every worker at once."""
        with self.lock:
            processes = [s.process for s in self.slots if s.process is not None]
        for process in processes:
            process.kill()
        stop_all(processes, 0.0)
        with self.lock:
            for slot in self.slots:
                slot.process = None
