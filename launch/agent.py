"""``NodeAgent``: torch's ``LocalElasticAgent`` with membership-aware restarts.

What it changes, each through a hook of torch's ``SimpleElasticAgent``/``LocalElasticAgent``
(signatures pinned by ``tests/unit/launch/test_agent_contract.py``):

* ``_start_workers``: adds ``ELASTIC_ROUND``, ``ELASTIC_RUN_ID``, ``ELASTIC_ETCD_ENDPOINTS`` and
  ``ELASTIC_AGENT_PID`` to the workers' environment every round (through the agent's own
  ``os.environ``, which torch copies into each worker).
* ``_monitor_workers``: a worker failure that coincides with a lost node is a membership change,
  not a crash. Survivors' workers usually fail *before* the dead node's lease expires (gloo
  reports a reset connection at once), so:

  - with restarts left, the failure is charged at once (no added latency) and refunded by
    ``_restart_workers`` if the next round shows that a node was lost;
  - with no restarts left, the failure is held (reported as ``HEALTHY``) for up to
    ``failure_settle_timeout`` while the agent waits for evidence of a lost node; if a node
    is lost (or one is waiting to join) the workers are restarted without charge, otherwise
    the failure stands.

* ``_restart_workers``: refunds a charged restart when the new round is smaller than the old
  one or the handler reported lost members.
* ``_exit_barrier``: waits for the *live* members of the round only (arrivals + lost members
  >= world size), so a dead agent does not hold the others for the whole timeout.

Planned departures (:mod:`launch.departure`): :meth:`NodeAgent.request_departure` (called by the
preemption monitor, from any thread) makes the main loop drain the workers, leave the rendezvous
and raise :class:`~launch.departure.PlannedDeparture`. On the other nodes a worker failure (or
a drained worker's exit 0) in a round where a peer announced its departure is a membership
change: restarted at once, never charged.

In-place mode (``inplace``, see :mod:`elastic.inplace`): the workers reconfigure themselves,
so the agent never restarts a healthy worker. A local worker failure deletes this node's
worker member keys at once (the survivors reconfigure within a monitor interval instead of a
lease TTL) and restarts this node's workers *without* a new rendezvous round; they join the
running job as newcomers and are healed by a survivor. The restart is charged as a crash, as
in restart mode. Nodes waiting to join make the agent take part in the next round (so that
they can start) without stopping its workers. torch's agent stops all of a node's workers
when one fails, so with ``--nproc-per-node`` above 1 a worker crash restarts its node's
workers (the other nodes keep training). In ``auto`` mode (the default) the agent acts so only
once this node's workers joined the in-place quorum (the script called
``elastic.init(inplace=True)``; the worker then creates the file named by
``ELASTIC_INPLACE_MARKER``); for other scripts every change restarts exactly as in ``restart``
mode.

Every transition is appended to the job event log (:mod:`elastic.eventlog`) when one is set.

The shared-TCPStore restart hang (pytorch#135712) is avoided by the runner, which sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every round the rank-0 worker hosts a fresh store on
a port published through the rendezvous store (etcd), so new workers can never read a dead
worker's address from an earlier round.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Final, NoReturn

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousHandler

from elastic import env
from elastic.etcd import EtcdClient
from elastic.eventlog import EventLog
from launch.departure import (
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_LEAVE_RESERVE,
    DepartureWatchdog,
    PlannedDeparture,
    drain_budget,
    drain_workers,
)
from launch.preemption import PreemptionNotice

logger = logging.getLogger(__name__)

EXIT_BARRIER_PREFIX: Final = "elastic/exit_barrier"
_BARRIER_POLL_S: Final = 0.2
_FAILED_STATES: Final = frozenset({WorkerState.FAILED, WorkerState.UNHEALTHY})


class MembershipView:
    """What the agent needs to know about membership, read from any rendezvous handler.

    Our ``ElasticRendezvousHandler`` answers ``lost_members()`` and ``round`` from memory; other
    handlers (torch's c10d) have neither, in which case no failure is ever reclassified and the
    round falls back to torch's dynamic-rendezvous state.
    """

    def __init__(self, handler: RendezvousHandler) -> None:
        self._handler = handler
        self._local_rounds = 0

    def lost_members(self) -> Collection[Any]:
        """Members of the current round whose lease expired (empty if unknown)."""
        fn: Callable[[], Collection[Any]] | None = getattr(self._handler, "lost_members", None)
        if fn is None:
            return ()
        try:
            return fn()
        except Exception:  # a membership read must never take the monitor loop down
            logger.debug("lost_members() failed", exc_info=True)
            return ()

    def departing_members(self) -> Collection[Any]:
        """Members of the current round that announced a planned departure (empty if unknown)."""
        fn: Callable[[], Collection[Any]] | None = getattr(self._handler, "departing_members",
                                                           None)
        if fn is None:
            return ()
        try:
            return fn()
        except Exception:
            logger.debug("departing_members() failed", exc_info=True)
            return ()

    def member_ttl(self) -> int | None:
        """TTL of the member leases, or None if the handler has none."""
        value = getattr(self._handler, "member_ttl", None)
        return value if isinstance(value, int) else None

    def announce_departure(self, note: Mapping[str, Any]) -> bool:
        """Tell the peers this node is leaving; False if the handler cannot (never raises)."""
        fn: Callable[[Mapping[str, Any]], bool] | None = getattr(
            self._handler, "announce_departure", None)
        if fn is None:
            return False
        try:
            return bool(fn(note))
        except Exception as exc:  # the departure goes on; the peers see the lease go instead
            logger.warning("Could not announce the departure in etcd (%s).", exc)
            return False

    def leave(self, timeout: timedelta, *, lease_only: bool = False) -> None:
        """Leave the rendezvous without closing it (never raises)."""
        fn: Callable[..., None] | None = getattr(self._handler, "leave", None)
        if fn is None:
            return
        try:
            fn(timeout, lease_only=lease_only)
        except Exception as exc:
            logger.warning("Could not leave the rendezvous cleanly (%s).", exc)

    def note_rendezvous(self) -> None:
        """Count a completed rendezvous (fallback round number)."""
        self._local_rounds += 1

    def round(self) -> int:
        """The current rendezvous round, as agreed by all nodes where the handler says so."""
        for obj in (self._handler, getattr(self._handler, "inner", None)):
            if obj is None:
                continue
            value = getattr(obj, "round", None)
            if callable(value):
                value = value()
            if isinstance(value, int):
                return value
            # torch's DynamicRendezvousHandler keeps the round in private state (contract-tested).
            holder = getattr(obj, "_state_holder", None)
            state = getattr(holder, "state", None)
            state_round = getattr(state, "round", None)
            if isinstance(state_round, int):
                return state_round
        return self._local_rounds - 1


@dataclass(frozen=True, slots=True)
class InPlaceOptions:
    """What the agent needs to run its workers in place.

    Attributes:
        client: etcd client for deleting this node's worker member keys.
        key_prefix: elastic-run's key prefix.
        ttl: Lease TTL of the workers' member keys (how long a lost node goes unnoticed).
        build_timeout: Seconds a new world's process groups wait for every member.
        auto: ``--elastic-mode auto``: in place only once one of this node's workers joined
            an in-place world (the script declared it with ``elastic.init(inplace=True)``; the
            worker creates the ``ELASTIC_INPLACE_MARKER`` file); until then every change
            restarts exactly as in restart mode, with no etcd call of its own.
    """

    client: EtcdClient
    key_prefix: str
    ttl: int
    build_timeout: float
    auto: bool = False


class NodeAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` whose restart budget is spent only on real worker crashes.

    Args:
        spec: the worker spec (as for ``LocalElasticAgent``).
        logs_specs: where worker logs go.
        start_method: multiprocessing start method (for function entrypoints).
        exit_barrier_timeout: seconds a finished node waits for live peers to finish.
        log_line_prefix_template: as for ``LocalElasticAgent``.
        shutdown_timeout: seconds between SIGTERM and SIGKILL when stopping workers.
        failure_settle_timeout: with no restarts left, seconds to wait after a worker failure
            for evidence of a lost node before the failure is final.
        etcd_endpoints: exported to workers as ``ELASTIC_ETCD_ENDPOINTS`` (``None``: not set).
        events: the job event log (``None``: no events).
        drain_timeout: on a preemption notice, the longest the workers get to stop and write a
            final checkpoint (shortened to fit the notice's deadline).
        leave_reserve: time kept before the notice's deadline to leave the rendezvous.
        inplace: run the workers in place (``None``: restart mode).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        *,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 120.0,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        failure_settle_timeout: float = 10.0,
        etcd_endpoints: str | None = None,
        events: EventLog | None = None,
        drain_timeout: timedelta = DEFAULT_DRAIN_TIMEOUT,
        leave_reserve: timedelta = DEFAULT_LEAVE_RESERVE,
        inplace: InPlaceOptions | None = None,
    ) -> None:
        super().__init__(
            spec=spec,
            logs_specs=logs_specs,
            start_method=start_method,
            exit_barrier_timeout=exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
        )
        self._membership = MembershipView(spec.rdzv_handler)
        self._failure_settle_timeout = failure_settle_timeout
        self._etcd_endpoints = etcd_endpoints
        self._held_failure: RunResult | None = None
        self._held_since = 0.0
        self._membership_restarts = 0
        self._events = events or EventLog(None, job="", source="agent")
        self._drain_timeout = drain_timeout
        self._leave_reserve = leave_reserve
        self._notice: PreemptionNotice | None = None
        self._departure = threading.Event()
        self._watchdog: DepartureWatchdog | None = None
        self._next_reason = "start"
        self._reported_lost: set[Any] = set()
        self._reported_departing: set[Any] = set()
        self._inplace = inplace
        self._inplace_restarts = 0
        # Auto mode: whether this node's workers were seen in place (the same script runs
        # every time, so once seen it stays so); they say so by creating the marker file.
        self._workers_joined_inplace = inplace is not None and not inplace.auto
        self._inplace_marker = ""
        self._workers_started_before = False  # [metrics hook]
        if inplace is not None and inplace.auto:
            marker_dir = tempfile.mkdtemp(prefix="elastic-inplace-")
            atexit.register(shutil.rmtree, marker_dir, ignore_errors=True)
            self._inplace_marker = os.path.join(marker_dir, "joined")

    @property
    def membership_restarts(self) -> int:
        """Restarts caused by membership changes (not charged to ``max_restarts``)."""
        return self._membership_restarts

    @property
    def remaining_restarts(self) -> int:
        """Restarts left for real worker crashes."""
        return int(self._remaining_restarts)

    @property
    def round(self) -> int:
        """The current rendezvous round (-1 before the first)."""
        return self._membership.round()

    @property
    def events(self) -> EventLog:
        """The job event log this agent writes to."""
        return self._events

    def request_departure(self, notice: PreemptionNotice) -> None:
        """Leave the job on ``notice`` (any thread; the main loop does the work, once).

        Also starts a watchdog that ends the process before the notice's deadline if the main
        loop cannot get to it in time (for example while a rendezvous round is forming).
        """
        if self._departure.is_set():
            return
        self._notice = notice
        self._departure.set()
        budget = drain_budget(notice, drain_timeout=self._drain_timeout,
                              leave_reserve=self._leave_reserve)
        self._watchdog = DepartureWatchdog(
            timedelta(seconds=budget) + self._leave_reserve + timedelta(seconds=1),
            self._emergency_exit,
        )
        self._watchdog.start()

    # -- hooks ------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._departure.is_set():
            self._depart(worker_group)  # don't join a round only to leave it
        super()._rendezvous(worker_group)
        self._membership.note_rendezvous()
        self._reported_lost.clear()
        self._reported_departing.clear()
        self._events.record(
            "round_started", round=self._membership.round(), group_rank=worker_group.group_rank,
            world=worker_group.group_world_size, reason=self._next_reason,
        )
        self._next_reason = "node_joined"
        if self._departure.is_set():
            self._depart(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # torch copies the agent's environment into every worker and then applies its own keys.
        round_ = self._membership.round()
        os.environ[env.ROUND] = str(round_)
        os.environ[env.RUN_ID] = worker_group.spec.rdzv_handler.get_run_id()
        os.environ[env.AGENT_PID] = str(os.getpid())
        if self._etcd_endpoints:
            os.environ[env.ETCD_ENDPOINTS] = self._etcd_endpoints
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if self._inplace is not None:
            os.environ[env.MODE] = "auto" if self._inplace.auto else "inplace"
            os.environ[env.INPLACE_MARKER] = self._inplace_marker
            os.environ[env.KEY_PREFIX] = self._inplace.key_prefix
            os.environ[env.INPLACE_TTL] = str(self._inplace.ttl)
            os.environ[env.INPLACE_BUILD_TIMEOUT] = str(self._inplace.build_timeout)
        else:
            os.environ[env.MODE] = "restart"
        logger.info(
            "Starting workers for round %s (group rank %s of %s, restarts left %s).",
            round_, worker_group.group_rank, worker_group.group_world_size,
            self._remaining_restarts,
        )
        pids: dict[int, Any] = super()._start_workers(worker_group)
        # [metrics hook] elastic_run_worker_restarts_total counts the starts after the first.
        self._events.record("workers_started", round=round_, workers=len(pids),
                            restart=self._workers_started_before)
        self._workers_started_before = True
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._departure.is_set():
            self._depart(worker_group)
        self._report_membership()
        result = self._held_failure or super()._monitor_workers(worker_group)
        if result.state in _FAILED_STATES and self._runs_in_place():
            self._drop_member_keys()
        departing = self._membership.departing_members()
        if result.state == WorkerState.SUCCEEDED and departing:
            # A peer's departure drained every rank; workers that return 0 when drained must
            # not end the job here: the survivors go on in a new round.
            logger.warning(
                "Workers stopped in a round that node(s) %s are leaving: starting a new round.",
                sorted(map(str, departing)),
            )
            self._membership_restart(worker_group, "planned_departure")
            return RunResult(state=WorkerState.HEALTHY)
        if result.state not in _FAILED_STATES:
            return result
        lost = self._membership.lost_members()
        if lost or departing:
            cause = "planned_departure" if departing and set(lost) <= set(departing) \
                else "node_lost"
            logger.warning(
                "Worker failure coincides with %s node(s) %s: treating it as a membership "
                "change; restarting without charging --max-restarts.",
                "departing" if cause == "planned_departure" else "lost",
                sorted(map(str, set(lost) | set(departing))),
            )
            self._record_failure(result, cause)
            self._membership_restart(worker_group, cause)
            return RunResult(state=WorkerState.HEALTHY)
        if self._remaining_restarts > 0:
            self._held_failure = None
            self._record_failure(result, "crash")
            return result  # charged now; _restart_workers refunds it if a node turns out lost
        now = time.monotonic()
        if self._held_failure is None:
            self._held_failure, self._held_since = result, now
            logger.warning(
                "Worker failure with no restarts left: waiting up to %.1f s for evidence of a "
                "lost node before failing the job.", self._failure_settle_timeout,
            )
        if now - self._held_since < self._failure_settle_timeout:
            # torch's HEALTHY branch restarts (uncharged) if a node is waiting to join.
            return RunResult(state=WorkerState.HEALTHY)
        self._held_failure = None
        self._record_failure(result, "crash")
        return result

    def _membership_restart(self, worker_group: WorkerGroup, reason: str) -> None:
        self._held_failure = None
        self._membership_restarts += 1
        self._next_reason = reason
        super()._restart_workers(worker_group)

    def _record_failure(self, result: RunResult, cause: str) -> None:
        codes = {rank: f.exitcode for rank, f in result.failures.items()}
        self._events.record("worker_failed", round=self._membership.round(), exit_codes=codes,
                            cause=cause)

    def _report_membership(self) -> None:
        """Log each newly lost or departing member of the round once (from memory)."""
        departing = set(self._membership.departing_members()) - self._reported_departing
        if departing:
            self._reported_departing |= departing
            self._events.record("peer_departed", round=self._membership.round(),
                                ranks=sorted(departing))
        lost = (set(self._membership.lost_members()) - self._reported_lost
                - self._reported_departing)
        if lost:
            self._reported_lost |= lost
            self._events.record("node_lost", round=self._membership.round(), ranks=sorted(lost))

    @property
    def inplace_restarts(self) -> int:
        """Local worker restarts done in place (without a rendezvous round)."""
        return self._inplace_restarts

    def _member_prefix(self) -> str:
        assert self._inplace is not None
        from elastic.inplace.quorum import node_member_prefix

        return node_member_prefix(self._inplace.key_prefix,
                                  self._worker_group.spec.rdzv_handler.get_run_id(), os.getpid())

    def _drop_member_keys(self) -> None:
        """Deletes this node's worker member keys so the survivors reconfigure at once."""
        assert self._inplace is not None
        try:
            self._inplace.client.delete_prefix(self._member_prefix())
        except Exception as exc:  # the keys' leases expire anyway, one TTL later
            logger.warning("Could not delete the failed workers' member keys (%s).", exc)

    def _runs_in_place(self) -> bool:
        """Whether this node's workers reconfigure in place (auto: once one created the marker)."""
        if self._inplace is None:
            return False
        if not self._workers_joined_inplace and os.path.exists(self._inplace_marker):
            self._workers_joined_inplace = True
        return self._workers_joined_inplace

    def _restart_in_place(self, worker_group: WorkerGroup) -> None:
        if worker_group.state in _FAILED_STATES:
            # A local crash: restart this node's workers only, in the same round; they
            # join the running world as newcomers and are healed by a survivor.
            self._held_failure = None
            self._drop_member_keys()
            self._next_reason = "worker_failed"
            self._stop_workers(worker_group)
            worker_group.state = WorkerState.STOPPED
            worker_ids = self._start_workers(worker_group)
            for local_rank, worker_id in worker_ids.items():
                worker_group.workers[local_rank].id = worker_id
            worker_group.state = WorkerState.HEALTHY
            self._inplace_restarts += 1
            self._events.record("workers_restarted_in_place", round=self._membership.round())
            return
        # Nodes are waiting (or were lost): take part in the next round so that joiners can
        # start; the workers here keep training and admit them at a step boundary.
        # torch's rendezvous rebuilds the Worker objects without their process ids, and its
        # monitor reports UNKNOWN when the ids no longer match the running processes.
        running_ids = [worker.id for worker in worker_group.workers]
        self._rendezvous(worker_group)
        for worker, worker_id in zip(worker_group.workers, running_ids, strict=False):
            worker.id = worker_id
        worker_group.state = WorkerState.HEALTHY
        self._membership_restarts += 1

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self._runs_in_place():
            self._restart_in_place(worker_group)
            return
        charged = worker_group.state in _FAILED_STATES
        self._held_failure = None
        old_world = worker_group.group_world_size
        departing = bool(self._membership.departing_members())
        lost_before = bool(self._membership.lost_members()) or departing
        if departing:
            self._next_reason = "planned_departure"
        elif lost_before:
            self._next_reason = "node_lost"
        elif charged:
            self._next_reason = "worker_failed"
        super()._restart_workers(worker_group)
        if not charged:
            self._membership_restarts += 1
            return
        new_world = worker_group.group_world_size
        if lost_before or (old_world is not None and new_world is not None
                           and new_world < old_world):
            self._remaining_restarts += 1
            self._membership_restarts += 1
            logger.warning(
                "The restart was caused by a lost node (world %s -> %s): not charged to "
                "--max-restarts (%s left).", old_world, new_world, self._remaining_restarts,
            )
            self._events.record("restart_refunded", round=self._membership.round(),
                                reason="planned_departure" if departing else "node_lost")

    def _depart(self, worker_group: WorkerGroup) -> NoReturn:
        """Drain the workers, leave the rendezvous, raise PlannedDeparture (main thread)."""
        notice = self._notice
        assert notice is not None  # set before the event
        started = time.monotonic()
        budget = drain_budget(notice, drain_timeout=self._drain_timeout,
                              leave_reserve=self._leave_reserve)
        round_ = self._membership.round()
        deadline = None if notice.deadline is None else notice.deadline.isoformat()
        left = notice.time_left()
        announced = self._membership.announce_departure({
            "source": notice.source, "deadline": deadline,
            "at": datetime.now(timezone.utc).isoformat(),
        })
        self._events.record(
            "planned_departure", round=round_, group_rank=worker_group.group_rank,
            notice=notice.source, deadline=deadline,
            time_left_s=None if left is None else round(left.total_seconds(), 3),
            drain_budget_s=round(budget, 3), member_ttl=self._membership.member_ttl(),
            announced=announced,
        )
        logger.warning(
            "Preemption notice from %s (deadline %s): stopping the workers (up to %.1f s for "
            "their final checkpoint), then leaving the rendezvous.", notice.source, deadline,
            budget,
        )
        codes, drained = drain_workers(self._pcontext, budget)
        exit_codes = {
            worker_group.workers[lr].global_rank if lr < len(worker_group.workers) else lr: code
            for lr, code in codes.items()
        }
        drain_s = time.monotonic() - started
        self._membership.leave(self._leave_reserve)
        self._events.record("left_rendezvous", round=round_, drained=drained,
                            exit_codes=exit_codes, drain_s=round(drain_s, 3))
        logger.warning(
            "Left the rendezvous %.1f s after the notice (workers %s, exit codes %s).",
            time.monotonic() - started, "drained" if drained else "killed", exit_codes,
        )
        if self._watchdog is not None:
            self._watchdog.cancel()
        raise PlannedDeparture(notice, drained=drained)

    def _emergency_exit(self) -> None:
        """The watchdog's way out: revoke the lease, log, and end the process with 0."""
        self._membership.leave(timedelta(seconds=1), lease_only=True)
        self._events.record("left_rendezvous", round=self._membership.round(), drained=False,
                            exit_codes={}, drain_s=None, forced=True)
        self._events.record("agent_exited", round=self._membership.round(),
                            outcome="departed", exit_code=0)
        self._events.close(timeout=1.0)  # [metrics hook] a URL log puts its last records
        logging.shutdown()
        # The workers die with the agent (worker_guard's parent-death signal).
        os._exit(0)

    def _exit_barrier(self) -> None:
        store = self._store
        world = self._worker_group.group_world_size
        if store is None or world is None:
            return
        deadline = time.monotonic() + float(self._exit_barrier_timeout)
        key = f"{EXIT_BARRIER_PREFIX}/arrived"
        logger.info(
            "Workers finished; waiting up to %.0f s for the live peers of this round.",
            self._exit_barrier_timeout,
        )
        self._in_exit_barrier = True
        try:
            store.add(key, 1)
            while True:
                arrived = int(store.add(key, 0))
                lost = len(self._membership.lost_members())
                if arrived + lost >= world:
                    logger.info(
                        "Exit barrier done: %s arrived, %s lost, world %s.", arrived, lost, world
                    )
                    return
                if time.monotonic() >= deadline:
                    logger.warning(
                        "Exit barrier timed out after %.0f s (%s of %s arrived, %s lost).",
                        self._exit_barrier_timeout, arrived, world, lost,
                    )
                    return
                time.sleep(_BARRIER_POLL_S)
        except Exception:  # torch's barrier logs and carries on too: the workers are done
            logger.exception("Exit barrier failed; exiting without waiting for peers.")
        finally:
            self._in_exit_barrier = False
