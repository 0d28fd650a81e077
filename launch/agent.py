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

The shared-TCPStore restart hang (pytorch#135712) is avoided by the runner, which sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every round the rank-0 worker hosts a fresh store on
a port published through the rendezvous store (etcd), so new workers can never read a dead
worker's address from an earlier round.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection
from typing import Any, Final

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

    @property
    def membership_restarts(self) -> int:
        """Restarts caused by membership changes (not charged to ``max_restarts``)."""
        return self._membership_restarts

    @property
    def remaining_restarts(self) -> int:
        """Restarts left for real worker crashes."""
        return int(self._remaining_restarts)

    # -- hooks ------------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._membership.note_rendezvous()

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # torch copies the agent's environment into every worker and then applies its own keys.
        round_ = self._membership.round()
        os.environ[env.ROUND] = str(round_)
        os.environ[env.RUN_ID] = worker_group.spec.rdzv_handler.get_run_id()
        os.environ[env.AGENT_PID] = str(os.getpid())
        if self._etcd_endpoints:
            os.environ[env.ETCD_ENDPOINTS] = self._etcd_endpoints
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        logger.info(
            "Starting workers for round %s (group rank %s of %s, restarts left %s).",
            round_, worker_group.group_rank, worker_group.group_world_size,
            self._remaining_restarts,
        )
        pids: dict[int, Any] = super()._start_workers(worker_group)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = self._held_failure or super()._monitor_workers(worker_group)
        if result.state not in _FAILED_STATES:
            return result
        lost = self._membership.lost_members()
        if lost:
            logger.warning(
                "Worker failure coincides with lost node(s) %s: treating it as a membership "
                "change; restarting without charging --max-restarts.", sorted(map(str, lost)),
            )
            self._held_failure = None
            self._membership_restarts += 1
            super()._restart_workers(worker_group)
            return RunResult(state=WorkerState.HEALTHY)
        if self._remaining_restarts > 0:
            self._held_failure = None
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
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        charged = worker_group.state in _FAILED_STATES
        self._held_failure = None
        old_world = worker_group.group_world_size
        lost_before = bool(self._membership.lost_members())
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
