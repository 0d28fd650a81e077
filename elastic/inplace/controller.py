"""The worker side of in-place reconfiguration: join, reconfigure, heal (see the package doc).

:func:`init_inplace` replaces :func:`elastic.init` when elastic-run runs the job in place
(``ELASTIC_MODE=inplace``, or ``auto`` with ``elastic.init(inplace=True)``). The returned
context's ``inplace`` attribute is an :class:`InPlaceController`, which
:class:`~elastic.loop.ElasticLoop` calls at four points:

* ``restore``: entering the loop: agree on the step with the world and heal, or read storage
  when nobody holds state;
* ``boundary_flag``: every ``end_step``: does the live membership differ from the world? The
  answer is all-reduced with the drain flag, so every rank reconfigures at the same step;
* ``abandon``: a collective of the step failed (a peer died): drop the step's gradients and
  the loader iterator, reconfigure before the next step;
* ``before_step``: a pending reconfiguration runs here: propose or adopt the next world (CAS
  on etcd), rebuild the groups, heal, re-plan the batch and re-shard the sampler.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Final

import torch
import torch.distributed as dist

from elastic import env
from elastic.context import ElasticContext, World
from elastic.errors import ConfigError
from elastic.etcd import EtcdClient, config_from_env
from elastic.inplace.groups import abort_groups, build_groups, standby_groups
from elastic.inplace.heal import HealResult, agree_and_heal
from elastic.inplace.liveness import LivenessSocket, ProbeBook
from elastic.inplace.quorum import WorkerQuorum, WorldView, member_id
from elastic.inplace.sockets import WorldSockets, socket_inodes
from elastic.process_group import ProcessGroups
from elastic.store import EtcdV3Store

if TYPE_CHECKING:
    from elastic.loop import ElasticLoop

__all__ = ["InPlaceController", "admissible", "init_inplace", "is_peer_failure"]

logger = logging.getLogger(__name__)

DEFAULT_TTL: Final = 3
DEFAULT_BUILD_TIMEOUT_S: Final = 10.0
_MAX_ATTEMPTS: Final = 100  # reconfigurations without a completed heal before giving up
_FAILURE_MARKERS: Final = ("gloo", "nccl", "connection", "timed out", "timeout", "peer",
                           "broken pipe", "aborted")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective failing because a peer is gone.

    gloo raises a plain ``RuntimeError`` ("Connection reset by peer", "Connection closed by
    peer") at once when a peer process dies; NCCL and store timeouts raise ``DistError``
    subclasses. A user error (a shape mismatch, a bug) is not one and propagates.
    """
    if isinstance(exc, dist.DistError):
        return True
    if type(exc) is not RuntimeError:
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _FAILURE_MARKERS)


def admissible(live: tuple[str, ...], global_batch: int | None) -> tuple[str, ...]:
    """The longest prefix of ``live`` (join order) whose size divides the global batch."""
    if global_batch is None:
        return live
    size = len(live)
    while size > 1 and global_batch % size != 0:
        size -= 1
    return live[:size]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} ({raw!r}) must be an integer.") from None


def _env_float(name: str, default: float) -> float:
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
        quorum: This worker's membership on etcd.
        store: The etcd store process groups rendezvous on.
        backend: ``"gloo"`` or ``"nccl"``.
        device: This worker's device.
        build_timeout: How long building a world's groups waits for every member.
        train_timeout: Collective timeout once a world is built (``None``: ``build_timeout``).
        initial_world_size: Workers the first world waits for (the agents' round size).
        liveness: This worker's liveness socket (see :mod:`~elastic.inplace.liveness`);
            ``None``: peers learn of this worker's death from its lease only.
    """

    def __init__(self, quorum: WorkerQuorum, store: EtcdV3Store, *, backend: str,
                 device: torch.device, build_timeout: timedelta,
                 train_timeout: timedelta | None, initial_world_size: int,
                 liveness: LivenessSocket | None = None) -> None:
        self.quorum = quorum
        self.liveness = liveness
        self.probes = ProbeBook()
        self.store = store
        self.backend = backend
        self.device = device
        self.build_timeout = build_timeout
        self.train_timeout = train_timeout
        self.initial_world_size = initial_world_size
        self.world: WorldView | None = None
        self.global_batch: int | None = None
        self.ctx: ElasticContext | None = None
        #: Why the next step boundary must reconfigure (``None``: it need not).
        self.pending: str | None = None
        #: Reconfigurations this process went through (successful group builds).
        self.reconfigurations = 0
        #: The last heal's outcome.
        self.last_heal: HealResult | None = None
        #: Seconds from a detected failure to the next completed heal, per failure.
        self.recovery_s: list[float] = []
        self._failed_at: float | None = None
        #: The current world's gloo sockets, shut down when this worker abandons it.
        self._world_sockets: WorldSockets | None = None
        #: A joiner registered not ready: it joins the world when the loop starts.
        self.deferred = False
        #: How long a deferred joiner waits to be admitted (``elastic.init``'s timeout).
        self.join_timeout = timedelta(minutes=30)
        #: The newest epoch this worker tried to build: a world is never built twice (its
        #: store prefix holds the failed attempt's keys), a failed one is followed by the next.
        self._tried_epoch = 0

    # -- joining and building worlds --------------------------------------------------------

    @property
    def me(self) -> str:
        """This worker's member id."""
        return self.quorum.me

    @property
    def rank(self) -> int:
        """This worker's rank in the current world."""
        assert self.world is not None
        return self.world.members.index(self.me)

    def register(self) -> WorldView | None:
        """Publishes this worker's member key; returns the running world it will join later.

        A worker that starts while a world of live members trains (a replacement, a new
        node) registers as *not ready*: the survivors keep training while it builds its
        model, and it is admitted when it enters the training loop (:meth:`restore`), so a
        slow start never stalls them. Workers that start a job (or restart one whose
        workers all died) register ready and form the first world in :meth:`join`.

        Returns:
            The world being trained when this worker defers its admission, else ``None``.
        """
        world = self.quorum.world(fresh=True)
        live = self.quorum.live_members(fresh=True)
        running = world if world is not None and set(world.members) & set(live) else None
        info: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid(),
                                   "started_at": time.time(), "ready": running is None}
        if self.liveness is not None:
            info["probe_port"] = self.liveness.port
        self.quorum.join(info)
        self.deferred = running is not None
        return running

    def join(self, timeout: timedelta) -> ProcessGroups:
        """Waits for (or forms) a world that includes this worker (after :meth:`register`)."""
        self.quorum.set_ready()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            self._exit_if_done()
            world = self.quorum.world(fresh=True)
            live = self.quorum.live_members(fresh=True)
            if world is None or not set(world.members) & set(live):
                # A fresh job: form the first world from the workers the agents started
                # together, once they are all registered. A job whose workers all died: the
                # agents' round size is stale (lost nodes do not start a new round in place),
                # so wait at most one build timeout for the others, then start with whoever
                # is there (latecomers are admitted at the next step boundary).
                settle = deadline - time.monotonic()
                if world is not None:
                    settle = min(settle, self.build_timeout.total_seconds())
                self.quorum.wait_until(
                    lambda q: q.done() is not None
                    or len(q.live_members()) >= self.initial_world_size
                    or (q.world() is not None and bool(set(q.world().members)
                                                      & set(q.live_members()))),
                    max(0.0, settle),
                )
                self._exit_if_done()
                live = self.quorum.live_members(fresh=True)
                world = self.quorum.world(fresh=True)
                if world is None or not set(world.members) & set(live):
                    world = self.quorum.propose(world, live[: self.initial_world_size])
            if self.me in world.members and world.epoch <= self._tried_epoch:
                world = self._next_world(after_failure=True)  # it failed to build: go on
            if self.me in world.members:
                groups = self._build(world)
                if groups is not None:
                    return groups
            else:
                self._wait_to_be_admitted(deadline)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker {self.me} was not admitted to a world within {timeout}; check "
                    "that the other workers of the job are running."
                )

    def _wait_to_be_admitted(self, deadline: float) -> None:
        logger.info("waiting to be admitted to the world (as a joiner or spare)")
        me = self.me
        self.quorum.wait_until(
            lambda q: q.done() is not None or (
                (w := q.world()) is not None and me in w.members
                and w.epoch > max(self.world.epoch if self.world else 0, self._tried_epoch)),
            max(0.1, deadline - time.monotonic()),
        )
        self._exit_if_done()

    def _exit_if_done(self) -> None:
        final = self.quorum.done()
        if final is not None:
            logger.info("the job finished at step %d before this worker was admitted", final)
            self.quorum.leave()
            raise SystemExit(0)

    def _build(self, world: WorldView) -> ProcessGroups | None:
        """Builds ``world``'s groups; ``None`` if a member did not arrive in time."""
        abort_groups()
        self._tried_epoch = max(self._tried_epoch, world.epoch)
        rank = world.members.index(self.me)
        started = time.monotonic()
        sockets_before = socket_inodes()
        try:
            groups = build_groups(
                self.backend, store=self.store, epoch=world.epoch, rank=rank,
                world_size=len(world.members), device=self.device, timeout=self.build_timeout,
            )
        except (RuntimeError, dist.DistError) as exc:
            logger.warning("world epoch %d could not be built (%s); trying the next one",
                           world.epoch, str(exc).splitlines()[0][:200])
            abort_groups()
            return None
        if self.train_timeout is not None:
            set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
            if set_timeout is not None:  # local: no barrier needed to *raise* a timeout
                set_timeout(self.train_timeout, groups.default)
                set_timeout(self.train_timeout, groups.checkpoint)
        if self.backend == "gloo":  # NCCL has its own abort (see abort_groups)
            self._world_sockets = WorldSockets(sockets_before, socket_inodes(),
                                               skip_ports=self.quorum.client.endpoint_ports())
        self.world = world
        self.reconfigurations += 1
        # Learn which peers answer a liveness probe, so that their refusal is trusted later.
        self.probes.learn_in_background(self._probe_addresses(world.members).values())
        logger.info("world epoch %d built in %.3fs: rank %d of %d", world.epoch,
                    time.monotonic() - started, rank, len(world.members))
        return groups

    def _probe_addresses(self, members: tuple[str, ...]) -> dict[str, tuple[str, int]]:
        """Member id -> liveness address, for the other members that published one."""
        found = {}
        for member in members:
            info = self.quorum.member_info(member) if member != self.me else None
            if info and isinstance(info.get("probe_port"), int):
                found[member] = (str(info["host"]), int(info["probe_port"]))
        return found

    def _remove_dead(self, members: set[str]) -> None:
        """Deletes the member keys of ``members`` whose process is certainly gone."""
        live = set(self.quorum.live_members())
        addresses = self._probe_addresses(tuple(sorted(members & live)))
        gone = self.probes.dead(addresses.values())
        for member, address in addresses.items():
            if address in gone:
                logger.warning("worker %s is gone (its liveness port %s:%d refuses); removing "
                               "its member key instead of waiting for its lease", member,
                               *address)
                self.quorum.remove(member)

    def _next_world(self, *, after_failure: bool) -> WorldView:
        """Proposes or adopts the world after the current one (see the package docstring)."""
        current_epoch = max(self.world.epoch if self.world else 0, self._tried_epoch)
        old = set(self.world.members) if self.world else set()
        if after_failure:
            # A dead worker's key goes when its agent deletes it (a worker kill: ~0.1 s), when
            # a survivor finds its liveness port closed (a node's process tree killed: one
            # probe), or when its lease expires (a host gone silent: <= ttl). Wait for the
            # first of these, not longer.
            self._remove_dead(old - {self.me})
            self.quorum.wait_until(
                lambda q: set(q.live_members()) != old
                or ((w := q.world()) is not None and w.epoch > current_epoch),
                self.quorum.ttl + 1.0,
            )
        current = self.quorum.world(fresh=True)
        live = self.quorum.live_members(fresh=True)
        if (current is not None and current.epoch > current_epoch
                and set(current.members) <= set(live)):
            return current  # somebody already proposed a world of live members: adopt it
        return self.quorum.propose(current, admissible(live, self.global_batch))

    def _sever_world(self) -> None:
        """Shuts down the broken world's connections so that no peer stays blocked on us."""
        if self._world_sockets is not None:
            severed = self._world_sockets.sever()
            self._world_sockets = None
            logger.info("shut down %d connection(s) of the abandoned world", severed)

    def _reconfigure(self, *, after_failure: bool) -> None:
        """Moves this worker into the next world, waiting as a spare if left out."""
        assert self.ctx is not None
        if after_failure:
            self._sever_world()
        for attempt in range(_MAX_ATTEMPTS):
            world = self._next_world(after_failure=after_failure or attempt > 0)
            if self.me not in world.members:
                abort_groups()
                self.world = WorldView(world.epoch, (), world.revision)
                self._wait_to_be_admitted(time.monotonic() + 24 * 3600)
                world = self.quorum.world(fresh=True) or world
                if self.me not in world.members:
                    continue
            groups = self._build(world)
            if groups is not None:
                self._install(groups)
                return
        raise RuntimeError(
            f"no world could be built after {_MAX_ATTEMPTS} attempts; the job's workers keep "
            "failing while reconfiguring."
        )

    def _install(self, groups: ProcessGroups) -> None:
        assert self.ctx is not None and self.world is not None
        old = self.ctx.world
        self.ctx._replace_world(
            World(rank=self.rank, world_size=len(self.world.members),
                  local_rank=old.local_rank, local_world_size=old.local_world_size,
                  group_rank=old.group_rank, round=self.world.epoch,
                  restart_count=old.restart_count, run_id=old.run_id),
            groups, generation=self.world.epoch,
        )

    # -- loop hooks -------------------------------------------------------------------------

    def restore(self, loop: ElasticLoop) -> None:
        """Agrees on the step with the world and heals, or restores from storage."""
        self.global_batch = loop.global_batch_size
        if self.deferred:
            # A joiner: its model is built now, so the survivors need not wait for it.
            self.deferred = False
            started = time.monotonic()
            self._install(self.join(self.join_timeout))
            logger.info("admitted to world epoch %d in %.3fs after entering the loop",
                        self.world.epoch if self.world else -1, time.monotonic() - started)
        self._heal(loop)

    def _heal(self, loop: ElasticLoop) -> None:
        assert self.ctx is not None
        for _ in range(_MAX_ATTEMPTS):
            try:
                result = agree_and_heal(loop.step if loop.has_state else -1,
                                        loop.heal_state(), self.ctx.checkpoint_group)
                if result.step < 0:
                    loop.restore_from_storage()
                self.last_heal = result
                loop.world_changed()
                if self._failed_at is not None:
                    self.recovery_s.append(time.monotonic() - self._failed_at)
                    self._failed_at = None
                self.pending = None
                return
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                logger.warning("a peer failed while healing (%s); reconfiguring again",
                               str(exc).splitlines()[0][:200])
                self._reconfigure(after_failure=True)
        raise RuntimeError(f"healing failed {_MAX_ATTEMPTS} times in a row; giving up.")

    def boundary_flag(self) -> bool:
        """True when the live membership no longer matches the world (from memory)."""
        if self.world is None:
            return False
        wanted = admissible(self.quorum.live_members(), self.global_batch)
        return wanted != self.world.members

    def request(self, reason: str) -> None:
        """Makes the next step boundary reconfigure (every rank agreed on ``reason``)."""
        if self.pending is None:
            self.pending = reason

    def abandon(self, exc: BaseException) -> None:
        """Records a failed step: the next boundary reconfigures after a failure."""
        logger.warning("step abandoned: a collective failed (%s)", str(exc).splitlines()[0][:200])
        if self._failed_at is None:
            self._failed_at = time.monotonic()
        self.pending = "failure"
        self._sever_world()  # now: a peer blocked on this worker must not wait for a timeout

    def before_step(self, loop: ElasticLoop) -> None:
        """Runs a pending reconfiguration and heal."""
        if self.pending is None:
            return
        started = time.monotonic()
        if (self.pending != "failure" and self.world is not None
                and set(self.world.members) <= set(self.quorum.live_members())):
            # A planned change (joiners admitted): every member of this world is alive and
            # here, so a save in flight on its groups can commit; tearing them down first
            # would fail it, and with frequent changes no checkpoint would ever commit.
            loop.settle_save()
        self._reconfigure(after_failure=self.pending == "failure")
        self._heal(loop)
        logger.info("reconfigured in %.3fs; continuing at step %d with %d ranks",
                    time.monotonic() - started, loop.step, len(self.world.members)
                    if self.world else 0)

    def finish(self, step: int, *, finished: bool) -> None:
        """Leaves the quorum; rank 0 of a finished job records it so that spares exit."""
        try:
            if finished and self.world is not None and self.world.members[:1] == (self.me,):
                self.quorum.mark_done(step)
        except Exception:  # the job is over either way; spares time out
            logger.warning("could not record the end of the job in etcd", exc_info=True)
        self.quorum.leave()
        if self.liveness is not None:
            self.liveness.close()


def init_inplace(backend: str, device: torch.device, *, init_timeout: timedelta,
                 train_timeout: timedelta | None) -> ElasticContext:
    """:func:`elastic.init` for in-place mode: join the job's world through etcd."""
    endpoints = os.environ.get(env.ETCD_ENDPOINTS, "")
    if not endpoints:
        raise ConfigError(
            f"in-place mode needs etcd but {env.ETCD_ENDPOINTS} is not set; start the job "
            "with elastic-run --etcd, or pass --elastic-mode restart."
        )
    run_id = os.environ.get(env.RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID", "none")
    client = EtcdClient(config_from_env(endpoints))
    key_prefix = os.environ.get(env.KEY_PREFIX, "/elastic")
    agent_pid = _env_int(env.AGENT_PID, os.getppid())
    quorum = WorkerQuorum(client, key_prefix=key_prefix, run_id=run_id,
                          me=member_id(agent_pid), ttl=_env_int(env.INPLACE_TTL, DEFAULT_TTL))
    build_timeout = timedelta(seconds=_env_float(env.INPLACE_BUILD_TIMEOUT,
                                                 DEFAULT_BUILD_TIMEOUT_S))
    store = EtcdV3Store(client, quorum.store_prefix, build_timeout)
    base = World.from_env()
    controller = InPlaceController(
        quorum, store, backend=backend, device=device, build_timeout=build_timeout,
        train_timeout=train_timeout, initial_world_size=base.world_size,
        liveness=LivenessSocket(),
    )
    controller.join_timeout = init_timeout
    running = controller.register()
    if running is None:
        groups = controller.join(init_timeout)
        assert controller.world is not None
        rank, world_size, epoch = controller.rank, len(controller.world.members), \
            controller.world.epoch
    else:
        # Until the loop admits it, a joiner stands alone on local groups, with the last rank
        # of the running world as a provisional rank (so that "rank 0 only" set-up code does
        # not run on it) and that world's size (which divides the global batch).
        groups = standby_groups(backend, device, build_timeout)
        world_size, epoch = len(running.members), running.epoch
        rank = world_size - 1
    marker = os.environ.get(env.INPLACE_MARKER, "")
    if marker:  # tells the agent (auto mode) that this job's workers run in place
        try:
            with open(marker, "a"):
                pass
        except OSError as exc:
            logger.warning("could not create the in-place marker %s (%s)", marker, exc)
    world = World(rank=rank, world_size=world_size,
                  local_rank=base.local_rank, local_world_size=base.local_world_size,
                  group_rank=base.group_rank, round=epoch,
                  restart_count=base.restart_count, run_id=run_id)
    # No lower_timeouts barrier: a joiner's first step is not the survivors' first step.
    ctx = ElasticContext(world, groups, device, train_timeout=None)
    ctx.generation = epoch
    ctx.inplace = controller
    controller.ctx = ctx
    if running is None:
        logger.info("joined in-place world epoch %d of run %s as rank %d of %d (backend %s)",
                    epoch, run_id, world.rank, world.world_size, backend)
    else:
        logger.info("run %s trains world epoch %d (%d ranks): this worker joins when its "
                    "training loop starts", run_id, epoch, world_size)
    return ctx
