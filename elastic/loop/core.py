"""``ElasticLoop``: which step runs next, on which world, with which data; saves and drains.

Two ways to write a training loop. The managed one owns the model wrapper, the optimizer
step and the data, so that every collective of a step happens inside a call the loop owns
and a peer's failure can abandon the step wherever it strikes::

    loop = elastic.ElasticLoop(ctx, model=model, optimizer=optimizer, data=dataset,
                               global_batch_size=256, micro_batch_size=32,
                               max_steps=10_000, checkpoint="s3://bucket/run")
    for x, y in loop.batches():
        loop.backward(loss_fn(loop.model(x), y))

The explicit one leaves each step to the script (its optimizer, its loader); in place each
step's body must then be inside ``with loop.step_guard():``::

    with elastic.ElasticLoop(ctx, state=..., checkpoint=mgr, sampler=sampler, ...) as loop:
        loader = DataLoader(dataset, batch_sampler=loop.batch_sampler())  # any world size
        for step in loop:
            with loop.step_guard():
                model_ddp = loop.data_parallel(model)
                for x, y in loop.micro_batches(loader, model_ddp):
                    loop.scale_loss(loss_fn(model_ddp(x), y)).backward()
                optimizer.step(); optimizer.zero_grad()
                loop.end_step()

Guarantees:

* Entering the loop loads the newest committed checkpoint (or, in place, heals from a
  survivor) or starts fresh; a checkpoint that does not fit is a :class:`ConfigError`.
* Step ``s`` trains stream positions ``[s * G, (s + 1) * G)`` of the sampler's epoch orders
  (``G`` the global batch), split over whatever world exists, and the gradient is the mean
  over those ``G`` samples, so the optimisation does not depend on the world size.
* Lost work is bounded (:mod:`~elastic.loop.saves`); in place it is the step in flight.
* SIGTERM drains: every rank agrees at a step boundary, saves and stops
  (:mod:`~elastic.loop.signals`).
* Every rank agrees on a drain and on a newer world at the same step, soon after any rank
  saw it (within about two agreements), with one small asynchronous all-reduce whose result
  is read at the next agreement (:class:`~elastic.boundary_flags.BoundaryFlags`): no
  blocking collective of its own, no device sync, and not one every step either: about one
  every 50 ms when steps are shorter (:class:`~elastic.boundary_flags.AgreementCadence`).

Under ``elastic-run --events-dir`` global rank 0 records ``step``, ``checkpoint`` and
``restored`` events in the job event log (:mod:`elastic.eventlog`).
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastic import env
from elastic.batching import BatchPlan, plan_batches
from elastic.boundary_flags import AgreementCadence, BoundaryFlags
from elastic.contract.messages import Drained, Progress
from elastic.eventlog import EventLog
from elastic.loop.agreement import StepAgreement
from elastic.loop.audit import SampleAudit
from elastic.loop.inplace_hooks import InPlaceHooks
from elastic.loop.loop_state import LOOP_KEY, LoopState, optimizers_in, python_rng_state
from elastic.loop.managed import ManagedWay
from elastic.loop.microbatch import MicroBatching
from elastic.loop.replicas import ElasticModel, Replicas
from elastic.loop.reporting import LoopReporting, tell_agent
from elastic.loop.rewind import StepRewind
from elastic.loop.saves import SaveSchedule
from elastic.loop.sharding import ShardedWay
from elastic.loop.signals import DrainSignal
from elastic_errors import ConfigError

if TYPE_CHECKING:
    from checkpointing import CheckpointManager
    from elastic.context import ElasticContext
    from elastic.sampler import ElasticSampler

__all__ = ["ElasticLoop"]

logger = logging.getLogger(__name__)

#: Restart mode: the agent hears of a completed step at most this often (see end_step).
_PROGRESS_EVERY_S = 0.5

class ElasticLoop(MicroBatching, ManagedWay, ShardedWay, InPlaceHooks, StepAgreement,
                  LoopReporting, StepRewind):
    """Drives the steps of an elastic job (see the module docstring for both ways).

    Args:
        ctx: The context from :func:`elastic.init` (``None``: single process, no groups).
        model: The managed way: the model (not wrapped in DDP: ``loop.model`` is). With
            ``parallelize``, in either way: the model with its initial weights.
        optimizer: The managed way: the optimizer (the loop steps it). With ``parallelize``:
            a callable of the parameters that makes it (``lambda p: torch.optim.AdamW(p)``).
        data: The managed way: a map-style ``Dataset`` (an :class:`ElasticSampler` is made
            for it), or an :class:`~elastic.stream.ElasticShardedStream` (its own cursor),
            yielding what the script's ``for ... in loop.batches()`` unpacks.
        scheduler: The managed way: an LR scheduler stepped after every optimizer step (with
            ``parallelize``: a callable of the optimizer that makes it).
        max_grad_norm: The managed way: clip the gradient norm to this before each step.
        loader_options: The managed way: extra ``DataLoader`` arguments (``num_workers``,
            ``collate_fn``, ``pin_memory``, ...).
        seed: The managed way: seed of the data order.
        state: What to checkpoint besides the loop's own state (and, in the managed way,
            besides the model and optimizer): ``Stateful`` objects, tensors or dicts.
        checkpoint: A ``CheckpointManager``, or a URL to make one on (``None``: none).
        sampler: The explicit way: the data sampler; the loop re-shards it and saves its
            cursor.
        max_steps: Optimizer steps of the whole job.
        checkpoint_interval: Save every this many steps (and at the last step and on drain).
        max_commit_lag: See :mod:`~elastic.loop.saves` (``None``: the interval).
        save_backpressure: ``"wait"`` (bound the lost work by waiting for a write slower
            than the interval) or ``"defer"`` (never wait for a write: a save due while the
            previous one is still written is deferred); see :mod:`~elastic.loop.saves`.
        global_batch_size: Samples per optimizer step over all ranks (fixed for the job).
        micro_batch_size: Largest per-rank forward/backward batch (``None``: the share).
        drain_timeout: How long a SIGTERM drain waits for its final checkpoint to commit.
        install_signal_handler: Install the SIGTERM drain handler (main thread only).
        parallelize: ``fn(model, mesh) -> model``: shard the model (``fully_shard``) on a
            ``DeviceMesh`` of each world instead of wrapping it in DDP; the loop calls it on
            every world and re-shards the state in place (``docs/sharded.md``).
        replicate: With ``parallelize``: HSDP replica groups (the mesh is
            ``("replicate", "shard")`` while the world size allows them).
        redundancy: With ``parallelize``: ``1`` keeps every shard also in a peer's host
            memory (or in its HSDP replica) so that a lost rank's shard is copied back
            without storage; ``0`` restores lost shards from storage.
        snapshot_every: With ``parallelize`` and ``redundancy=1``: refresh the peer copies
            after every this many steps (``None``: chosen from measurement so that refreshes
            take at most 1 % of the training time); a loss rolls back to the last refresh.

    Raises:
        ConfigError: On invalid values.
    """

    def __init__(
        self,
        ctx: ElasticContext | None,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        data: Any = None,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        loader_options: Mapping[str, Any] | None = None,
        seed: int = 0,
        state: Mapping[str, Any] | None = None,
        checkpoint: CheckpointManager | str | None = None,
        sampler: ElasticSampler | None = None,
        max_steps: int,
        checkpoint_interval: int = 100,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        drain_timeout: timedelta = timedelta(seconds=25),
        install_signal_handler: bool = True,
        max_commit_lag: int | None = None,
        save_backpressure: str = "wait",
        parallelize: Any = None,
        replicate: int = 1,
        redundancy: int = 1,
        snapshot_every: int | None = None,
    ) -> None:
        if max_steps < 0:
            raise ConfigError(f"max_steps ({max_steps}) must be non-negative.")
        user_state = dict(state or {})
        if LOOP_KEY in user_state:
            raise ConfigError(f"state key ({LOOP_KEY!r}) is reserved for the loop; rename it.")
        sharded = parallelize is not None
        if not sharded and (replicate != 1 or snapshot_every is not None):
            raise ConfigError(
                f"replicate ({replicate}) and snapshot_every ({snapshot_every}) shape a sharded "
                "model; pass parallelize= too, or leave them out."
            )
        if sharded and (model is None or optimizer is None):
            raise ConfigError(
                "parallelize= needs model= (with its initial weights) and optimizer= (a "
                "callable of the parameters, e.g. lambda p: torch.optim.AdamW(p)); pass both."
            )
        managed = data is not None or (not sharded and (model is not None
                                                         or optimizer is not None))
        if managed and not sharded and (model is None or optimizer is None or data is None):
            raise ConfigError(
                "the managed loop needs model, optimizer and data together (got "
                f"model={type(model).__name__}, optimizer={type(optimizer).__name__}, "
                f"data={type(data).__name__}); pass all three, or none and step yourself."
            )
        self.ctx = ctx
        self.max_steps = max_steps
        self.global_batch_size = global_batch_size
        self._requested_micro = micro_batch_size
        world = ctx.world_size if ctx is not None else 1
        rank = ctx.rank if ctx is not None else 0
        self.plan: BatchPlan = plan_batches(
            global_batch_size, micro_batch_size or global_batch_size, world)
        # The managed way: the loop owns model, optimizer, data and their state.
        self._module, self.optimizer, self.scheduler = model, optimizer, scheduler
        self._max_grad_norm = max_grad_norm
        self._data, self._loader_options = data, dict(loader_options or {})
        if sharded:
            # Built on the first world (the optimizer and scheduler too): see ShardedWay.
            self._module = self.optimizer = self.scheduler = None
        if managed:
            from checkpointing import ModelOptimizerState
            from elastic.loop.data import managed_sampler

            sampler = managed_sampler(data, sampler, seed)
            if not sharded:
                assert model is not None and optimizer is not None
                user_state = {"train": ModelOptimizerState(model, optimizer), **user_state}
                if scheduler is not None:
                    user_state.setdefault("scheduler", scheduler)
        self.sampler = sampler
        if sampler is not None:
            sampler.reshard(rank, world)
            sampler.set_global_batch_size(global_batch_size)
        if isinstance(checkpoint, str):
            from checkpointing import CheckpointManager

            checkpoint = CheckpointManager(
                checkpoint, process_group=ctx.checkpoint_group if ctx is not None else None,
                round=ctx.round if ctx is not None else 0)
        self.checkpoint = checkpoint
        self._user_state = user_state
        self._events = EventLog.from_env()
        self._round = ctx.round if ctx is not None else None
        self.saves = SaveSchedule(checkpoint, interval=checkpoint_interval,
                                  max_commit_lag=max_commit_lag, drain_timeout=drain_timeout,
                                  record=self._record, backpressure=save_backpressure)
        self._drain = DrainSignal()
        self._install_signal_handler = install_signal_handler
        # In-place reconfiguration (elastic.inplace): the controller, unless elastic-run runs
        # the job in restart mode. The script is declared in-place capable by its first
        # guarded step: only a step inside step_guard() can survive a peer's failure.
        controller = getattr(ctx, "inplace", None)
        if controller is not None and os.environ.get(env.MODE, "auto") == "restart":
            controller = None
        self._inplace: Any = controller
        self._sharded = self._copies = None
        if sharded:
            assert model is not None
            self._setup_sharding(model, parallelize=parallelize, optimizer=optimizer,
                                 scheduler=scheduler, replicate=replicate,
                                 redundancy=redundancy, snapshot_every=snapshot_every,
                                 micro_batch_size=micro_batch_size)
            self._user_state = user_state = {**self._sharded_state(), **user_state}
        if checkpoint is not None and getattr(checkpoint, "events", None) is None:
            checkpoint.events = self._events
        if managed and not sharded and _only_optimizer_writes(model, user_state):
            # The next step's forward and backward only read the saved tensors: the copy of
            # a save may run until the optimizer step (elastic.loop.saves).
            assert optimizer is not None
            self.saves.hold_at_optimizer_step = True
            optimizer.register_step_pre_hook(lambda *_args: self.saves.hold_copy())
        if controller is not None:
            if checkpoint is not None:
                checkpoint.commit_fence = controller.may_commit
            for opt in optimizers_in(user_state.values()):
                # NCCL: a step of an aborted world must never be applied (see the controller):
                # gated on the device (the managed loop can rewind its host state), or the
                # host waits for the step's collectives first.
                snapshot = self.host_step if opt is optimizer else None
                opt.register_step_pre_hook(
                    lambda o, *_args, s=snapshot: controller.before_optimizer_step(o, s))
                opt.register_step_post_hook(
                    lambda o, *_args: controller.after_optimizer_step(o))
            self.saves.before_save = controller.before_save
            controller.check_config(self)
        self.replicas = Replicas(
            ctx, in_place=controller is not None, step=lambda: self.step,
            on_bucket_rebuild=controller.reached_collective if controller is not None else None)
        self._flags: BoundaryFlags | None = None
        self._cadence = AgreementCadence()
        #: Completed optimizer steps; the index of the next step to run.
        self.step = 0
        #: Step the loop resumed from (0 on a fresh start).
        self.resumed_from = 0
        #: Whether this process holds the job's state (restored, healed or trained a step).
        self.has_state = False
        #: Times this process read a checkpoint from storage (in place: only with no survivor).
        self.storage_loads = 0
        self._drained = False
        self._restored = False
        self._abandoned = False
        self._batches: Iterator[Any] | None = None
        self._loader: Iterable[Any] | None = None
        self._batches_generation = ctx.generation if ctx is not None else 0
        self._step_started: float | None = None
        self._progress_told = 0.0  # when the agent last heard of a step (restart mode)
        self._micro: tuple[int, int] = (0, 1)  # the step's current micro-batch: index, count
        self._micro_size = self.plan.micro_batch_size  # its samples
        self._audit = SampleAudit.from_env() if managed else None
        self._wrapper: ElasticModel | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def _full_state(self) -> dict[str, Any]:
        return {**self._user_state, LOOP_KEY: LoopState(self)}

    def restore(self) -> int:
        """Loads the newest committed checkpoint (or starts fresh); returns the next step.

        In place (:mod:`elastic.inplace`), the world first agrees on the step and heals from a
        survivor; storage is read only when no rank holds state.

        Raises:
            ConfigError: If the checkpoint does not fit this job's state or global batch.
        """
        self._restored = True
        if self._inplace is not None:
            self._inplace.restore(self)
            return self.step
        return self.restore_from_storage()

    @property
    def sharded(self) -> bool:
        """Whether the loop trains a sharded model (``parallelize=``)."""
        return self._sharded is not None

    def restore_from_storage(self) -> int:
        """Loads the newest committed checkpoint (or starts fresh); returns the next step."""
        self._restored = True
        self.has_state = True
        if self._sharded is not None:
            self._build_alone()
        if self.checkpoint is None:
            if self._sharded is not None:
                self._sharded_loaded(False)
            return self.step
        self.storage_loads += 1
        started = time.monotonic()
        from checkpointing.errors import CheckpointError

        try:
            info = self.checkpoint.load(self._full_state())
        except (CheckpointError, ConfigError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            # DCP reports key/shape mismatches as CheckpointException (a BaseException) whose
            # text is every rank's traceback; its last line is the reason.
            lines = [line for line in str(exc).splitlines() if line.strip()]
            reason = lines[-1].strip() if lines else type(exc).__name__
            raise ConfigError(
                f"the newest checkpoint in ({self.checkpoint.storage.url}) does not fit this "
                f"job's model or state ({reason[:200]}); point the checkpoint URL at a new "
                "directory or restore the code that wrote it."
            ) from exc
        if self._sharded is not None:
            self._sharded_loaded(info is not None)
        self._record("restored", round=self._round, step=self.step, found=info is not None,
                     duration_s=round(time.monotonic() - started, 4),
                     read_from=getattr(self.checkpoint, "last_load_source", None))
        if info is None:
            logger.info("fresh start: no committed checkpoint")
            return self.step
        self.resumed_from = self.step
        self.saves.restored(self.step)
        logger.info("resumed at step %d from %s", self.step, info.path)
        return self.step

    def _apply_loaded(self, state: Mapping[str, Any]) -> None:
        saved_batch = int(state["global_batch_size"])
        if saved_batch != self.global_batch_size:
            raise ConfigError(
                f"the checkpoint was trained with global batch size ({saved_batch}) but this "
                f"run asks for ({self.global_batch_size}); keep the global batch of a job "
                "fixed or start it in a new checkpoint directory."
            )
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(python_rng_state(state["python_rng"]))
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        if self.sampler is not None:
            if "sampler" not in state:
                raise ConfigError(
                    "the checkpoint has no sampler cursor but this job has a sampler; start "
                    "it in a new checkpoint directory."
                )
            self.sampler.load_state_dict(state["sampler"])

    def __enter__(self) -> ElasticLoop:
        if not self._restored:
            # Before the drain handler: until it holds the job's state a worker has nothing
            # to save, and SIGTERM (its agent restarting it) must end it at once, even while
            # it waits for a world or a peer's state.
            self.restore()
        if self._install_signal_handler:
            self._drain.install()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(wait=exc_type is None)

    def close(self, wait: bool = True) -> None:
        """Waits for the last save (when ``wait``), closes the manager, restores SIGTERM,
        and stops the loader's worker processes (they ignore SIGTERM, so nothing else would
        before the interpreter's exit waits for them)."""
        self._drain.uninstall()
        self._batches = self._loader = None
        if wait:
            self.settle_collectives()
        if self._copies is not None:
            self._copies.close()
        if self.checkpoint is not None:
            self.checkpoint.close(wait=wait)
        if self._inplace is not None:
            self._inplace.finish(self.step, finished=self.finished)
        # Step records wait up to a tenth of a second to go to the agent together: send the
        # last ones now, without waiting on anything.
        self._events.flush(0.0)

    def request_drain(self) -> None:
        """Asks the loop to save and stop at the next step boundary (what SIGTERM does)."""
        self._drain.request()

    @property
    def drained(self) -> bool:
        """True when the loop stopped early because of a drain request."""
        return self._drained

    @property
    def finished(self) -> bool:
        """True when ``max_steps`` steps are done."""
        return self.step >= self.max_steps

    # -- steps ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """Yields the index of each step still to run; stops at ``max_steps`` or a drain."""
        if not self._restored:
            self.restore()
        while True:
            self.saves.before_step()  # the training stream waits for a save's copy
            if self._inplace is not None:
                self._inplace.before_step(self)  # a pending reconfiguration and heal
                if self._inplace.left:
                    logger.info("left the job at step %d (this node departs)", self.step)
                    return
            if self.step >= self.max_steps or self._drained:
                return
            started = self.step
            self._step_started = time.monotonic()
            self._abandoned = False
            if self._inplace is not None:
                self._inplace.step_started(started)
            yield started
            if self.step == started and not self._abandoned:
                raise RuntimeError(
                    f"step ({started}) ended without loop.end_step(); call it after "
                    "optimizer.step()."
                )

    def end_step(self) -> None:
        """Closes the step: advances the data cursor, saves when due, and agrees with every
        rank on draining and on switching to a newer world."""
        if self.sampler is not None:
            self.sampler.advance(self.global_batch_size)
        self.step += 1
        self.has_state = True
        started, self._step_started = self._step_started, None
        self.saves.blocked_s = 0.0
        if self.ctx is not None:
            self.ctx.after_first_step()
        drain = self._agree()
        self._refresh_copies()
        if drain:
            self._drained = True
        state = self._full_state()
        self.saves.after_step(self.step, state, last=self.step >= self.max_steps,
                              drained=drain, round_=self._round)
        if not drain and self.step < self.max_steps:
            self.saves.reserve(state)  # staging buffers, now that the state exists
        if drain:
            logger.info("drained at step %d", self.step)
            tell_agent(Drained(self.step))
        if started is not None:
            compute = max(0.0, time.monotonic() - started - self.saves.blocked_s)
            if self._inplace is not None:
                self._inplace.step_completed(self.step - 1, compute)
            elif time.monotonic() - self._progress_told >= _PROGRESS_EVERY_S:
                # The agent tells a node cut off from the job from a job-wide etcd outage by
                # whether its workers still train (in place the controller reports steps).
                self._progress_told = time.monotonic()
                tell_agent(Progress(self.step))
            # The step's compute and its agreement; checkpoint stalls are their own events.
            self._record("step", round=self._round, step=self.step - 1,
                         duration_s=round(compute, 4),
                         world=self.ctx.world_size if self.ctx is not None else 1)


def _only_optimizer_writes(model: nn.Module | None, user_state: Mapping[str, Any]) -> bool:
    """Whether the managed loop's optimizer step is the only writer of the saved tensors:
    the model's state is its parameters (no persistent buffers, which a forward may update)
    and nothing but the loop's own entries is saved."""
    if model is None or set(user_state) - {"train", "scheduler"}:
        return False
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return set(model.state_dict(keep_vars=True)) <= params
