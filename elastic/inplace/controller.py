"""The worker side of in-place reconfiguration: join, reconfigure, heal (see the package doc).

Workers never talk to etcd. The node agent tells them the world (``elastic.agent_link``);
this module turns that into process groups and into the decisions of
:class:`~elastic.loop.ElasticLoop`, which calls the controller at five points:

* ``restore``: entering the loop: a joiner is admitted now; then agree on the step with the
  world and heal, or read storage when nobody holds state;
* ``boundary_epoch``: every ``end_step``: the newest world this worker knows; all-reduced
  (MAX) with the drain flag, so every rank switches to a newer world at the same boundary;
* ``abandon``: a collective of the step failed and membership confirms a peer is gone: drop
  the step's gradients and the loader iterator, reconfigure before the next step;
* ``before_step``: a pending reconfiguration runs here: build the next world's groups,
  heal, re-plan the batch, re-shard the data;
* ``finish``: the loop ended.

When a member of the world this worker trains in (or builds) is gone — the agent reports a
newer world without it that does not mark it as departed, or reports a local peer dead — the
world is aborted at once from the link's thread (:class:`WorldGuard`): a collective blocked
on a silent peer fails now instead of at its timeout. So is a world that a newer one leaves
this worker itself out of (evicted, or its node dropped while cut off): it then waits to be
admitted as a newcomer, and never completes a step of its stale world. A newer world that
only adds workers, or drops departing ones, is a planned change: no abort, the switch happens
at a boundary.
"""

from __future__ import annotations

import logging
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final, Protocol

import torch
import torch.distributed as dist

from elastic import env
from elastic.agent_link import AgentLink
from elastic.context import ElasticContext, World
from elastic.contract.messages import (
    AgentMessage,
    BuildFailed,
    Declare,
    Finished,
    Progress,
    Ready,
    Resumed,
    Stalled,
    Suspect,
    Waiting,
)
from elastic.contract.records import WorldRecord
from elastic.failures import is_peer_failure_type
from elastic.inplace.abort import WorldAbort
from elastic.inplace.groups import abort_groups, build_groups, set_group_timeout, standby_groups
from elastic.inplace.heal import HealResult, agree_and_heal
from elastic.inplace.step_fence import (
    STEP_FENCE_ENV,
    FenceMode,
    StepFence,
    step_fence_from_env,
)
from elastic.process_group import ProcessGroups
from elastic_errors import ConfigError, ElasticError, JobFatalError
from torch_private import TCPStore


class ElasticLoop(Protocol):
    """What the controller needs of ``elastic.loop.ElasticLoop`` (no import of it)."""

    step: int
    has_state: bool
    global_batch_size: int
    checkpoint: Any  # a CheckpointManager or None

    def heal_state(self) -> dict[str, Any]: ...
    def world_changed(self) -> None: ...
    def restore_from_storage(self) -> int: ...
    def settle_save(self) -> None: ...
    def rewind(self, point: Any) -> None: ...
    def step_gate_blocker(self) -> str | None: ...

__all__ = ["InPlaceController", "SpoiledStateError", "StepRetriesExceeded", "init_inplace"]

logger = logging.getLogger(__name__)

DEFAULT_BUILD_TIMEOUT_S: Final = 10.0
DEFAULT_HANG_TIMEOUT_S: Final = 10.0
DEFAULT_HANG_FACTOR: Final = 10.0
DEFAULT_MAX_STEP_RETRIES: Final = 3
_EVIDENCE_TIMEOUT_S: Final = 4.0  # a crash is reported in ~0.1 s, a silent host in ~ttl
_MAX_BUILDS: Final = 100
_STEP_TIMES: Final = 50


class StepRetriesExceeded(JobFatalError):
    """The same step was abandoned more often than allowed: a persistent fault, not a peer
    (the job stops with it)."""


class SpoiledStateError(ElasticError):
    """No rank holds sound state and there is no checkpoint to roll back to (only with
    ``ELASTIC_NCCL_STEP_FENCE=0``)."""


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} ({raw!r}) must be a number.") from None


class InPlaceController:
    """Keeps one worker in the job's world across membership changes.

    Args:
        link: The channel to this node's agent.
        backend: ``"gloo"`` or ``"nccl"``.
        device: This worker's device.
        build_timeout: How long building a world's groups waits for every member.
        train_timeout: Collective timeout once a world is built (``None``: ``build_timeout``).
    """

    def __init__(self, link: AgentLink, *, backend: str, device: torch.device,
                 build_timeout: timedelta, train_timeout: timedelta | None) -> None:
        self.link = link
        self.backend = backend
        self.device = device
        self.build_timeout = build_timeout
        self.train_timeout = train_timeout
        self.world: WorldRecord | None = None
        self.ctx: ElasticContext | None = None
        self.global_batch: int | None = None
        #: Why the next step boundary must reconfigure (``None``: it need not).
        self.pending: str | None = None
        #: Successful group builds in this process.
        self.reconfigurations = 0
        self.last_heal: HealResult | None = None
        #: Seconds from a detected failure to the next completed heal, per failure.
        self.recovery_s: list[float] = []
        #: Set when this worker's node departs (a notice): the loop then stops.
        self.left = False
        self.deferred = False
        self.declared = False
        self.join_timeout = timedelta(minutes=30)
        self.max_step_retries = int(_env_number("ELASTIC_MAX_STEP_RETRIES",
                                                DEFAULT_MAX_STEP_RETRIES))
        self._guard: WorldAbort | None = None
        #: NCCL only: keeps a step of an aborted world from being applied, or notes that it
        #: was (elastic.inplace.step_fence).
        self.fence = (StepFence(device, mode=step_fence_from_env()) if backend == "nccl"
                      else None)
        self._building: WorldRecord | None = None
        self._failed_at: float | None = None
        self._retries: dict[int, int] = {}
        self._tried_epoch = 0
        # Progress rule (see membership.proposal.laggards).
        self.hang_timeout = _env_number(env.HANG_TIMEOUT, DEFAULT_HANG_TIMEOUT_S)
        self.hang_factor = _env_number(env.HANG_FACTOR, DEFAULT_HANG_FACTOR)
        self._step_times: deque[float] = deque(maxlen=_STEP_TIMES)
        self._arrived: tuple[int, float] | None = None
        self._reported_waiting: int | None = None
        self._reported_stalled: tuple[int, int] | None = None  # (epoch, step)
        self._step = -1
        self._completed = -1  # the step after the last one this worker completed
        self._reported_step = -2
        #: Called before this worker's world's groups are dropped (background work on them,
        #: such as a sharded model's copy transfers, must be done first).
        self.before_drop: list[Any] = []
        link.add_listener(self._on_message)
        link.add_ticker(self._tick)
        link.peer_check = self.peer_failure_evident

    # -- identity ---------------------------------------------------------------------------

    @property
    def me(self) -> str:
        """This worker's job-wide id."""
        return self.link.me

    @property
    def rank(self) -> int:
        """This worker's rank in the current world."""
        assert self.world is not None
        return self.world.ranks().index(self.me)

    def declare(self, global_batch: int | None) -> None:
        """Tells the agent this worker reconfigures in place (it uses ``ElasticLoop``)."""
        self.global_batch = global_batch
        if self.declared:
            return
        self.declared = True
        if not self.deferred:
            self.link.send(Declare(inplace=True, max_world=global_batch))

    # -- membership evidence ----------------------------------------------------------------

    def _members_gone(self, world: WorldRecord | None) -> set[str]:
        """Members of ``world`` known gone: dead, evicted, or left out of a newer world
        without being marked as departing."""
        if world is None:
            return set()
        members = set(world.ranks())
        gone = members & self.link.gone
        newest = self.link.world
        if newest is not None and newest.epoch > world.epoch:
            gone |= (members - set(newest.ranks())) - set(newest.departed)
        return gone - {self.me}

    def _peers_lost(self, world: WorldRecord | None) -> set[str]:
        """Members of ``world`` (other than this worker) a newer world names lost or evicted:
        the evidence that a failed collective was a peer's failure."""
        if world is None:
            return set()
        newest = self.link.world
        named = set(self.link.gone)
        if newest is not None and newest.epoch > world.epoch:
            named |= set(newest.lost) | set(newest.evicted)
        return (set(world.ranks()) & named) - {self.me}

    def _left_out(self, world: WorldRecord | None) -> bool:
        """Whether a newer world than ``world`` leaves this worker out (not as departing):
        it was evicted, or its node was dropped (cut off longer than its lease). Its world
        is then stale: the others have moved on, so it must never complete a step in it."""
        newest = self.link.world
        return (world is not None and newest is not None and newest.epoch > world.epoch
                and self.me not in newest.ranks() and self.me not in newest.departed)

    def _missed_worlds(self, world: WorldRecord | None) -> bool:
        """Whether a newer world than ``world`` came with the worlds between unseen: one of
        them may have left this worker out (its node cut off from etcd longer than its lease,
        then back), so its peers may have left ``world`` long ago, and a growth-looking newest
        world proves nothing. Its world is then stale (a needless abort costs one step)."""
        newest = self.link.world
        return (world is not None and newest is not None and newest.epoch > world.epoch
                and self.link.unseen_after >= world.epoch)

    def _on_message(self, message: AgentMessage | None = None) -> None:
        """Aborts the current world (or the one being built) when membership says so."""
        guard = self._guard
        if guard is None or guard.aborted:
            return
        building, training = self._building, self.world
        newest = self.link.world
        if building is not None and newest is not None and newest.epoch > building.epoch:
            guard.abort(f"world epoch {newest.epoch} replaced epoch {building.epoch} while "
                        "it was being built")
            return
        gone = self._members_gone(building or training)
        if gone:
            guard.abort(f"member(s) {', '.join(sorted(gone))} are gone")
        elif self._left_out(building or training):
            assert newest is not None
            guard.abort(f"this worker is not in world epoch {newest.epoch}")
        elif self._missed_worlds(building or training):
            assert newest is not None
            guard.abort(f"world epoch {newest.epoch} came with the worlds after epoch "
                        f"{self.link.unseen_after} unseen (this node was cut off): the "
                        "peers may have left this world")
        elif self.link.evicted is not None or self.link.end is not None:
            guard.abort(self.link.evicted or "the run ended")

    # -- progress rule ----------------------------------------------------------------------

    def step_started(self, step: int) -> None:
        """The loop began ``step``."""
        self._step = self.link.step = step
        self._arrived = None

    def reached_collective(self) -> None:
        """This worker reached the step's gradient collective (its last micro-batch)."""
        if self._arrived is None:
            self._arrived = (self._step, time.monotonic())

    def step_completed(self, step: int, duration: float) -> None:
        """The loop completed ``step`` in ``duration`` seconds of compute."""
        self._step_times.append(duration)
        self._arrived = None
        self._step = self.link.step = self._completed = step + 1
        if self._reported_waiting is not None or self._reported_stalled is not None:
            self._reported_waiting = self._reported_stalled = None
            self.link.send(Resumed())

    def hang_threshold(self) -> float:
        """Seconds of waiting in a collective after which a peer is reported as holding it."""
        if not self._step_times:
            return float("inf")  # no step yet: the first step includes warm-up and builds
        return max(self.hang_timeout, self.hang_factor * statistics.median(self._step_times))

    def stall_threshold(self) -> float:
        """Seconds of waiting in a collective after which the agent checks for silent peers
        (the agent's rule, :mod:`membership.silent_peers`, passed on in its welcome)."""
        rule = self.link.stall
        if not self._step_times or rule is None:
            return float("inf")
        return max(rule.floor_s, rule.factor * statistics.median(self._step_times))

    def _tick(self) -> None:
        """Heartbeat-thread check: report progress, and report waiting past the threshold."""
        # Completed steps only: a new worker begins at the step it restored or was healed
        # to, which is no evidence that it trains (its agent tells a node cut off from the
        # job from an etcd outage by whether its workers still train).
        if self._completed != self._reported_step:
            self._reported_step = self._completed
            self.link.send(Progress(self._completed))
        arrived, world = self._arrived, self.world
        if arrived is None or world is None:
            return
        waited = time.monotonic() - arrived[1]
        if self._reported_stalled != (world.epoch, arrived[0]) and waited > self.stall_threshold():
            self._reported_stalled = (world.epoch, arrived[0])
            self.link.send(Stalled(world.epoch, arrived[0]))
        if self._reported_waiting != arrived[0] and waited > self.hang_threshold():
            self._reported_waiting = arrived[0]
            logger.warning("waited %.1f s in the collective of step %d: reporting it",
                           time.monotonic() - arrived[1], arrived[0])
            self.link.send(Waiting(world.epoch, arrived[0]))

    # -- building worlds --------------------------------------------------------------------

    def _wait_for_world(self, predicate: Any, timeout: float, what: str) -> WorldRecord:
        if not self.link.wait(lambda link: link.end is not None or link.evicted is not None
                              or predicate(link.world), timeout):
            raise TimeoutError(f"worker {self.me} waited {timeout:.0f} s for {what}; check "
                               "that the other nodes of the job are running.")
        self._exit_if_over()
        world = self.link.world
        assert world is not None
        return world

    def _exit_if_over(self) -> None:
        end = self.link.end
        if end is not None:
            logger.info("the run ended (%s): %s", end.outcome, end.reason)
            raise SystemExit(0 if end.outcome == "finished" else 1)
        if self.link.evicted is not None:
            logger.warning("evicted by the agent: %s", self.link.evicted)
            raise SystemExit(1)

    def _build(self, world: WorldRecord) -> ProcessGroups | None:
        """Builds ``world``'s groups; ``None`` if it failed (a member did not come, or the
        world was replaced or aborted meanwhile)."""
        self._drop_world()
        self._tried_epoch = max(self._tried_epoch, world.epoch)
        rank = world.ranks().index(self.me)
        # Created before the store client connects: an abort during the build (a member
        # gone, a newer world) severs the store connection too, so the build fails now.
        guard = WorldAbort(skip_fds={self.link.fileno}, name=f"epoch {world.epoch}",
                           on_abort=self.fence.on_abort if self.fence is not None else None)
        self._guard, self._building = guard, world
        started = time.monotonic()
        self._on_message()  # a change that landed before the guard existed
        try:
            guard.check()
            client = TCPStore(world.store[0], world.store[1], is_master=False,
                              timeout=self.build_timeout)
            groups = build_groups(
                self.backend, store=client, epoch=world.epoch, rank=rank,
                world_size=world.world_size, device=self.device, timeout=self.build_timeout,
                world_abort=guard,
            )
        except (RuntimeError, dist.DistError, ValueError) as exc:
            logger.warning("world epoch %d could not be built (%s)", world.epoch,
                           str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            abort_groups(guard)
            self._building = None
            # Nobody else may know (the others may be waiting for this worker): the leader
            # writes this world again once its members' builds have all ended.
            self.link.send(BuildFailed(world.epoch))
            return None
        self._building = None
        if self.train_timeout is not None:
            set_group_timeout(self.train_timeout, groups.default, groups.checkpoint)
        self.world = world
        self.reconfigurations += 1
        logger.info("world epoch %d built in %.3fs: rank %d of %d", world.epoch,
                    time.monotonic() - started, rank, world.world_size)
        self._on_message()  # a loss reported during the build: abort now, not at a timeout
        return groups

    def _drop_world(self) -> None:
        """Destroys the current world's groups (the steps it still runs are resolved first)."""
        for settle in self.before_drop:
            settle()
        if self.fence is not None:
            self.fence.settle(self._guard)
        abort_groups(self._guard)

    def adopt_groups(self, before: dict[int, int], *groups: Any) -> None:
        """Adds groups built after the current world (a device mesh's, a background group) to
        it: a member's loss aborts them with the world's own
        (:meth:`~elastic.inplace.abort.WorldAbort.adopt`).

        Args:
            before: :func:`torch_private.socket_inodes` taken before building them.
            groups: The groups.

        Raises:
            WorldAbortedError: If the world was aborted meanwhile.
        """
        guard = self._guard
        if guard is not None:
            guard.adopt(before, *groups)

    def join(self, timeout: timedelta) -> ProcessGroups:
        """Waits for a world that includes this worker and builds it."""
        deadline = time.monotonic() + timeout.total_seconds()
        for _ in range(_MAX_BUILDS):
            world = self._wait_for_world(
                lambda w: w is not None and self.me in w.ranks() and w.epoch > self._tried_epoch,
                deadline - time.monotonic(), "a world that includes it")
            groups = self._build(world)
            if groups is not None:
                return groups
        raise RuntimeError(f"worker {self.me} could not build a world in {_MAX_BUILDS} tries")

    def _install(self, groups: ProcessGroups) -> None:
        assert self.ctx is not None and self.world is not None
        old = self.ctx.world
        mine = self.world.member(self.link.node)
        self.ctx._replace_world(
            World(rank=self.rank, world_size=self.world.world_size,
                  local_rank=old.local_rank,
                  local_world_size=len(mine.workers) if mine else old.local_world_size,
                  group_rank=self.world.node_rank(self.link.node), round=self.world.epoch,
                  restart_count=old.restart_count, run_id=old.run_id),
            groups, generation=self.world.epoch,
        )

    def _reconfigure(self, *, after_failure: bool) -> None:
        """Moves this worker into the next world, waiting as a spare if left out."""
        current = self.world.epoch if self.world is not None else 0
        for _ in range(_MAX_BUILDS):
            world = self._wait_for_world(
                lambda w: w is not None and w.epoch > max(current, self._tried_epoch),
                24 * 3600.0, "the next world")
            if self.me in world.departed:
                self.left = True
                self._drop_world()
                logger.info("this worker's node departs: leaving the job at step boundary")
                return
            if self.me not in world.ranks():
                self._drop_world()
                logger.info("not in world epoch %d: waiting to be admitted", world.epoch)
                self._tried_epoch = max(self._tried_epoch, world.epoch)
                continue
            groups = self._build(world)
            if groups is not None:
                self._install(groups)
                return
        raise RuntimeError(f"worker {self.me}: no world could be built in {_MAX_BUILDS} "
                           "attempts; the job's workers keep failing while reconfiguring.")

    # -- loop hooks -------------------------------------------------------------------------

    def restore(self, loop: ElasticLoop) -> None:
        """Admits a joiner now that its model is built; agrees on the step and heals."""
        self.global_batch = loop.global_batch_size
        if self.deferred:
            self.deferred = False
            started = time.monotonic()
            self.link.send(Ready(inplace=True, max_world=self.global_batch))
            self._install(self.join(self.join_timeout))
            logger.info("admitted to world epoch %d in %.3fs after entering the loop",
                        self.world.epoch if self.world else -1, time.monotonic() - started)
        self._heal(loop)

    def _heal(self, loop: ElasticLoop) -> None:
        assert self.ctx is not None
        for _ in range(_MAX_BUILDS):
            try:
                self._rewind(loop)
                spoiled = self.fence is not None and self.fence.spoiled
                if spoiled:
                    logger.warning("this worker applied step(s) whose collective an abort cut "
                                   "short (%s=0): it reports no state and is healed, or "
                                   "restores the last checkpoint", STEP_FENCE_ENV)
                if getattr(loop, "sharded", False):
                    # A sharded model re-shards the survivors' shards and copies instead.
                    result = loop.heal_sharded(self, spoiled)  # type: ignore[attr-defined]
                else:
                    result = agree_and_heal(loop.step if loop.has_state and not spoiled
                                            else -1, loop.heal_state(),
                                            self.ctx.checkpoint_group, device=self.device)
                if spoiled and result.step < 0:
                    self._check_rollback(loop)
                # Re-plan, re-shard and move the checkpoint manager to this world first: a
                # restore reads storage with this world's collectives.
                loop.world_changed()
                if result.step < 0:
                    loop.restore_from_storage()
                if self.fence is not None:
                    self.fence.replaced()
                self.last_heal = result
                if self._failed_at is not None:
                    self.recovery_s.append(time.monotonic() - self._failed_at)
                    self._failed_at = None
                self.pending = None
                return
            except Exception as exc:
                if not self.confirm_peer_failure(exc):
                    raise
                logger.warning("a peer failed while healing (%s); reconfiguring again",
                               str(exc).splitlines()[0][:200])
                self._reconfigure(after_failure=True)
                if self.left:
                    return
        raise RuntimeError(f"healing failed {_MAX_BUILDS} times in a row; giving up.")

    def _check_rollback(self, loop: ElasticLoop) -> None:
        """A spoiled worker is about to restore from storage: there must be a checkpoint.

        Raises:
            SpoiledStateError: If there is none (a fresh start would keep the garbage).
        """
        checkpoint = loop.checkpoint
        if checkpoint is not None and checkpoint.latest() is not None:
            return
        where = f"in {checkpoint.storage.url}" if checkpoint is not None else "(none is kept)"
        if self.fence is not None and self.fence.mode is FenceMode.DEVICE:
            raise SpoiledStateError(
                f"the stream did not finish after world {self.world.epoch if self.world else -1}"
                " was aborted, so this worker cannot tell which steps the device skipped, no "
                f"rank holds a sound state and no checkpoint is committed {where}, so training "
                f"cannot go on; set {STEP_FENCE_ENV}=1 or keep a checkpoint."
            )
        raise SpoiledStateError(
            f"step {loop.step - 1} was applied on an NCCL collective that an abort cut short "
            f"({STEP_FENCE_ENV}=0), no rank holds a sound state and no checkpoint is "
            f"committed {where}, so training cannot go on; unset {STEP_FENCE_ENV} (the "
            "default waits for each step's collectives and loses at most the step in flight)."
        )

    def in_place(self) -> bool:
        """Whether this worker's world reconfigures in place (every worker declared it);
        in a restart-mode world the agent restarts the workers on a change instead."""
        newest, current = self.link.world, self.world
        return (newest is not None and current is not None and newest.mode == "inplace"
                and newest.epoch >= current.epoch)

    def boundary_epoch(self) -> int:
        """The newest world epoch to switch to (all-reduced at every step boundary): the
        current one while the world is not in place."""
        current = self.world.epoch if self.world is not None else 0
        newest = self.link.world
        if newest is None or not self.in_place():
            return current
        return max(current, newest.epoch)

    def change_pending(self) -> bool:
        """Whether a newer world than this worker's is known (it switches at a boundary)."""
        return self.world is not None and self.boundary_epoch() > self.world.epoch

    def request(self, reason: str) -> None:
        """Makes the next step boundary reconfigure (every rank agreed on ``reason``)."""
        if self.pending is None:
            self.pending = reason

    def confirm_peer_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` comes from a peer's failure: its type can, and membership agrees.

        The evidence is the agent's: a member of this world dead, evicted or left out of a
        newer world (or this worker already aborted the world because of it). A failure of
        the right type with no such evidence within a few seconds (the worker asks its
        agent to probe the world's other nodes meanwhile) is not a peer's: it is raised.
        """
        if not is_peer_failure_type(exc):
            return False
        guard = self._guard
        if guard is not None and guard.aborted:
            return True
        world = self.world
        if world is not None:
            nodes = [n for n in world.nodes() if n != self.link.node]
            self.link.send(Suspect(tuple(nodes)))
        return self.link.wait(lambda _l: bool(self._peers_lost(world)) or
                              (guard is not None and guard.aborted),
                              _EVIDENCE_TIMEOUT_S)

    def peer_failure_evident(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a peer's failure by the evidence at hand, without waiting.

        What a dying worker tells its agent: the agent waits for membership evidence itself
        (a few seconds) before it charges the crash, so the worker need not wait as well;
        when every rank dies of the script's own error, that wait would only delay the end.
        Without evidence yet, the agent is asked to probe the world's other nodes (a dead
        node's record then goes at once, not when its lease expires).
        """
        if not is_peer_failure_type(exc):
            return False
        guard = self._guard
        if (guard is not None and guard.aborted) or self._peers_lost(self.world):
            return True
        world = self.world
        if world is not None:
            self.link.send(Suspect(tuple(n for n in world.nodes() if n != self.link.node)))
        return False

    def abandon(self, exc: BaseException, step: int) -> None:
        """Records a step abandoned because a peer failed: the next boundary reconfigures.

        Raises:
            StepRetriesExceeded: If ``step`` was abandoned more than ``max_step_retries``
                times.
        """
        count = self._retries.get(step, 0) + 1
        self._retries = {step: count}
        error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        if count > self.max_step_retries:
            # One sentence: the error's first (gloo appends advice in more, and prefixes the
            # source location of the check that failed).
            error = re.sub(r"^\[[^\]]*\]\s*", "", error)
            error = re.split(r"(?<=\.)\s", error, maxsplit=1)[0].rstrip(".")
            raise StepRetriesExceeded(
                f"step {step} was abandoned {count} times (last error: {error}); stopping, "
                "since a fault that survives every reconfiguration is not a lost peer "
                "(ELASTIC_MAX_STEP_RETRIES raises the limit)."
            ) from exc
        logger.warning("step %d abandoned (%d of %d): %s", step, count,
                       self.max_step_retries, error)
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        self.pending = "failure"
        guard = self._guard
        if guard is not None:  # a peer blocked on this worker must not wait for a timeout
            guard.abort(f"step {step} abandoned ({error})")

    def before_step(self, loop: ElasticLoop) -> None:
        """Runs a pending reconfiguration and heal."""
        if self.pending is None:
            return
        started = time.monotonic()
        newest = self.link.world
        if (self.pending != "failure" and self.world is not None and newest is not None
                and not self._members_gone(self.world)):
            # A planned change: every member of this world is alive, so a save in flight on
            # its groups can commit; tearing them down first would fail it.
            loop.settle_save()
        self._reconfigure(after_failure=self.pending == "failure")
        if self.left:
            return
        self._heal(loop)
        logger.info("reconfigured in %.3fs; continuing at step %d with %d ranks",
                    time.monotonic() - started, loop.step,
                    self.world.world_size if self.world else 0)

    def may_commit(self) -> bool:
        """Whether a checkpoint may be committed now (the commit fence).

        Only while the node's lease is fresh and this worker's world was not aborted: a
        node cut off from etcd, or a worker the job has moved on without, never commits.
        """
        guard = self._guard
        return self.link.lease_ok and self.link.evicted is None and (
            guard is None or not guard.aborted)

    def before_optimizer_step(self, optimizer: Any = None,
                              snapshot: Callable[[], Any] | None = None) -> None:
        """Refuses to apply a step whose world was aborted (NCCL; see
        :mod:`~elastic.inplace.step_fence`: the step is gated on the device, or the host
        waits for its collectives first). gloo's collectives fail in the aborted call
        itself: nothing to do.

        Args:
            optimizer: The optimizer about to step.
            snapshot: Returns the loop's host state at the start of the step (the device
                gate rewinds to it if the device skips the step).

        Raises:
            WorldAbortedError: If the world was aborted.
        """
        guard = self._guard
        if guard is not None and self.fence is not None:
            self.fence.before_optimizer_step(guard, optimizer, snapshot)

    def after_optimizer_step(self, optimizer: Any) -> None:
        """The optimizer stepped: the device gate gives it back its own ``found_inf``."""
        if self.fence is not None:
            self.fence.after_optimizer_step(optimizer)

    def _rewind(self, loop: ElasticLoop) -> None:
        """Device gate: rewinds the loop's host state to the first step the device skipped
        when the last world was dropped (its bookkeeping ran ahead of the device)."""
        point = self.fence.rewind_point() if self.fence is not None else None
        if point is not None:
            loop.rewind(point)

    def check_agreement(self) -> None:
        """The step agreement's flags were just read: with NCCL and no per-step wait, they
        may come from a collective an abort cut short, so an aborted world raises.

        Raises:
            WorldAbortedError: If they cannot be trusted.
        """
        guard = self._guard
        if guard is not None and self.fence is not None and not self.fence.wait:
            guard.check()

    def before_save(self) -> Callable[[], None] | None:
        """State is about to be staged for a checkpoint: with NCCL and no per-step wait,
        refuses a state of an aborted world (checking later: waits for the stream now).

        Returns:
            A check to run once the state's copy is complete (the device gate), or ``None``.

        Raises:
            WorldAbortedError: If the world was aborted.
        """
        guard = self._guard
        if guard is not None and self.fence is not None:
            return self.fence.before_save(guard)
        return None

    def check_config(self, loop: ElasticLoop) -> None:
        """Refuses settings that cannot work together (called when the loop is built).

        Raises:
            ConfigError: ``ELASTIC_NCCL_STEP_FENCE=0`` without a checkpoint, or ``device``
                where the loop's steps cannot be gated on the device.
        """
        if self.fence is not None:
            self.fence.configure(loop.step_gate_blocker())
        if (self.fence is not None and self.fence.mode is FenceMode.LATER
                and loop.checkpoint is None):
            raise ConfigError(
                f"{STEP_FENCE_ENV}=0 rolls survivors back to the last checkpoint when a step's "
                "collective is aborted, but this ElasticLoop keeps none; pass checkpoint= or "
                f"unset {STEP_FENCE_ENV}."
            )

    def finish(self, step: int, *, finished: bool) -> None:
        """Tells the agent the job finished (from the world's rank 0) and closes the link.

        A loop that did not finish keeps the link open: it may be closing because the script
        raised (Python closes the loop's generator while the exception unwinds, before the
        worker reports it), and that report must still reach the agent over this link, with
        the step it failed at and the membership evidence of a peer's failure.
        """
        if not finished:
            return
        if self.world is not None and self.world.ranks()[:1] == (self.me,):
            if not self.may_commit():
                # Its world may no longer be the job's: a node cut off from etcd trains on
                # alone in a world of one, and the commit fence refused its final checkpoint.
                # Ending the job now would end it without that checkpoint; exiting as a
                # failure of the partition (not charged) lets the job finish it instead.
                logger.warning("finished step %d in world epoch %d, which may no longer be "
                               "the job's (this node's lease is not fresh): not ending the job",
                               step, self.world.epoch)
                raise SystemExit(1)
            self.link.send(Finished(step))
        self.link.close()


def init_inplace(link: AgentLink, backend: str, device: torch.device, *,
                 init_timeout: timedelta, train_timeout: timedelta | None,
                 declare: bool) -> ElasticContext:
    """:func:`elastic.init` under elastic-run: join the world the agent reports.

    Args:
        link: The channel to the node agent.
        backend: The process-group backend.
        device: This worker's device.
        init_timeout: How long to wait for a world and its groups.
        train_timeout: Collective timeout once built.
        declare: Declare in-place capability now (``--elastic-mode inplace``); otherwise the
            ``ElasticLoop`` declares it (``auto``), or nothing does (``restart``).
    """
    build_timeout = timedelta(seconds=_env_number(env.INPLACE_BUILD_TIMEOUT,
                                                  DEFAULT_BUILD_TIMEOUT_S))
    controller = InPlaceController(link, backend=backend, device=device,
                                   build_timeout=build_timeout, train_timeout=train_timeout)
    controller.join_timeout = init_timeout
    base = World.from_env()
    joiner = os.environ.get(env.START) == "joiner"
    if joiner:
        # Until the loop admits it, a joiner stands alone on local groups, with the last rank
        # of the running world as a provisional rank (so "rank 0 only" set-up code does not
        # run on it) and that world's size.
        controller.deferred = True
        controller.declared = declare
        groups = standby_groups(backend, device, build_timeout)
        world = base
    else:
        if declare:
            controller.declare(None)
        groups = controller.join(init_timeout)
        assert controller.world is not None
        mine = controller.world.member(link.node)
        world = World(rank=controller.rank, world_size=controller.world.world_size,
                      local_rank=base.local_rank,
                      local_world_size=len(mine.workers) if mine else base.local_world_size,
                      group_rank=controller.world.node_rank(link.node),
                      round=controller.world.epoch, restart_count=base.restart_count,
                      run_id=base.run_id)
    ctx = ElasticContext(world, groups, device, train_timeout=None)
    ctx.generation = world.round
    ctx.inplace = controller
    controller.ctx = ctx
    logger.info("%s world epoch %d of run %s as rank %d of %d (backend %s)",
                "joining" if joiner else "joined", world.round, base.run_id, world.rank,
                world.world_size, backend)
    return ctx
