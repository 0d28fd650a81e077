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
* Every rank agrees on a drain and on a newer world one step after any rank saw it, with
  one small asynchronous all-reduce per step whose result is read a step later
  (:class:`~elastic.boundary_flags.BoundaryFlags`): no blocking collective of its own, no
  device sync.

Under ``elastic-run --events-dir`` global rank 0 records ``step``, ``checkpoint`` and
``restored`` events in the job event log (:mod:`elastic.eventlog`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastic import env
from elastic.batching import BatchPlan, plan_batches
from elastic.boundary_flags import BoundaryFlags
from elastic.eventlog import EventLog
from elastic.loop.audit import IndexedCollate, IndexedDataset, SampleAudit
from elastic.loop.loop_state import LOOP_KEY, LoopState, optimizers_in, python_rng_state
from elastic.loop.replicas import ElasticModel, Replicas, to_device
from elastic.loop.saves import SaveSchedule
from elastic.loop.signals import DrainSignal, shield_workers_from_sigterm
from elastic_errors import ConfigError

if TYPE_CHECKING:
    from checkpointing import CheckpointManager
    from elastic.context import ElasticContext
    from elastic.sampler import ElasticSampler

__all__ = ["ElasticLoop"]

logger = logging.getLogger(__name__)

_DRAIN, _NEWER_WORLD = 0, 1
#: Restart mode: the agent hears of a completed step at most this often (see end_step).
_PROGRESS_EVERY_S = 0.5


class ElasticLoop:
    """Drives the steps of an elastic job (see the module docstring for both ways).

    Args:
        ctx: The context from :func:`elastic.init` (``None``: single process, no groups).
        model: The managed way: the model (not wrapped in DDP: ``loop.model`` is).
        optimizer: The managed way: the optimizer (the loop steps it).
        data: The managed way: a map-style ``Dataset`` (an :class:`ElasticSampler` is made
            for it) yielding what the script's ``for ... in loop.batches()`` unpacks.
        scheduler: The managed way: an LR scheduler stepped after every optimizer step.
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
        global_batch_size: Samples per optimizer step over all ranks (fixed for the job).
        micro_batch_size: Largest per-rank forward/backward batch (``None``: the share).
        drain_timeout: How long a SIGTERM drain waits for its final checkpoint to commit.
        install_signal_handler: Install the SIGTERM drain handler (main thread only).

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
    ) -> None:
        if max_steps < 0:
            raise ConfigError(f"max_steps ({max_steps}) must be non-negative.")
        user_state = dict(state or {})
        if LOOP_KEY in user_state:
            raise ConfigError(f"state key ({LOOP_KEY!r}) is reserved for the loop; rename it.")
        managed = data is not None or model is not None or optimizer is not None
        if managed and (model is None or optimizer is None or data is None):
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
        if managed:
            from checkpointing import ModelOptimizerState
            from elastic.sampler import ElasticSampler

            assert model is not None and optimizer is not None
            if sampler is None:
                sampler = ElasticSampler(len(data), seed=seed)
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
                                  record=self._record)
        self._drain = DrainSignal()
        self._install_signal_handler = install_signal_handler
        # In-place reconfiguration (elastic.inplace): the controller, unless elastic-run runs
        # the job in restart mode. The script is declared in-place capable by its first
        # guarded step: only a step inside step_guard() can survive a peer's failure.
        controller = getattr(ctx, "inplace", None)
        if controller is not None and os.environ.get(env.MODE, "auto") == "restart":
            controller = None
        self._inplace: Any = controller
        if checkpoint is not None and getattr(checkpoint, "events", None) is None:
            checkpoint.events = self._events
        if controller is not None:
            if checkpoint is not None:
                checkpoint.commit_fence = controller.may_commit
            for opt in optimizers_in(user_state.values()):
                # NCCL: a step of an aborted world must never be applied (see the controller).
                opt.register_step_pre_hook(lambda *_args: controller.before_optimizer_step())
            self.saves.before_save = controller.before_save
            controller.check_config(self)
        self.replicas = Replicas(ctx, in_place=controller is not None)
        self._flags: BoundaryFlags | None = None
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

    # -- batch plan -------------------------------------------------------------------------

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step on the current world."""
        return self.plan.grad_accum_steps

    @property
    def micro_batch_size(self) -> int:
        """Samples per micro-batch on the current world (use it as the DataLoader batch)."""
        return self.plan.micro_batch_size

    @property
    def loss_scale(self) -> float:
        """Factor for each micro-batch's *mean* loss so that the accumulated, rank-averaged
        gradient is the mean over the global batch."""
        return self.plan.loss_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Scales the current micro-batch's *mean* loss for the global batch (by its own
        sample count, so uneven shares still give the global batch's mean gradient)."""
        return loss * self.plan.loss_scale_for(self._micro_size)

    def batch_sampler(self) -> Iterable[list[int]]:
        """This rank's micro-batches of indices, step after step: build the explicit way's
        loader once with ``DataLoader(dataset, batch_sampler=loop.batch_sampler())``; it
        works at any world size and follows every world change (:meth:`micro_batches`
        starts a new pass over it, at the sampler's cursor, under the new world's plan)."""
        if self.sampler is None:
            raise ConfigError("batch_sampler() needs the loop's sampler; pass sampler= to "
                              "ElasticLoop.")
        return _StepBatches(self.sampler, lambda: self.plan)

    def _rank(self) -> int:
        return self.ctx.rank if self.ctx is not None else 0

    def micro_batches(self, loader: Iterable[Any],
                      model: nn.Module | None = None) -> Iterator[Any]:
        """Yields this step's micro-batches from ``loader`` (the explicit way).

        The loader's iterator is kept across steps (it is endless over the sampler's stream),
        so DataLoader workers are started once; they ignore SIGTERM. With a DDP ``model``,
        all but the last micro-batch run under ``model.no_sync()``: gradients are all-reduced
        once per step. Call ``backward()`` before asking for the next micro-batch.

        Raises:
            ConfigError: If the loader's batch size is not :attr:`micro_batch_size`.
        """
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is not None and batch_size != self.plan.micro_batch_size:
            raise ConfigError(
                f"DataLoader batch_size ({batch_size}) differs from the micro batch of this "
                f"world ({self.plan.micro_batch_size}); build the loader with "
                "batch_sampler=loop.batch_sampler(), which follows every world."
            )
        if batch_size is not None and not self.plan.even:
            raise ConfigError(
                f"world size ({self.plan.world_size}) splits the global batch "
                f"({self.global_batch_size}) unevenly, which a fixed DataLoader batch_size "
                "cannot follow; build the loader with batch_sampler=loop.batch_sampler()."
            )
        generation = self.ctx.generation if self.ctx is not None else 0
        if (self._batches is None or self._loader is not loader
                or self._batches_generation != generation):
            self._batches_generation = generation
            self._loader = loader
            shield_workers_from_sigterm(loader)
            self._batches = iter(loader)
        no_sync = getattr(model, "no_sync", None)
        sizes = self.plan.micro_batch_sizes(self._rank())
        last = len(sizes) - 1
        for index, size in enumerate(sizes):
            batch = next(self._batches)
            self._micro, self._micro_size = (index, len(sizes)), size
            if no_sync is not None and index < last:
                with no_sync():
                    yield batch
            else:
                if self._inplace is not None:
                    # The step's gradient collective comes with this micro-batch's backward:
                    # from here on this rank waits for its peers (the progress rule).
                    self._inplace.reached_collective()
                yield batch

    # -- the managed way --------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The managed model: call it like the model; it runs DDP on the current world."""
        if self._module is None:
            raise ConfigError("loop.model needs the managed loop; pass model=, optimizer= "
                              "and data= to ElasticLoop.")
        if self._wrapper is None:
            self._wrapper = ElasticModel(self._module, self._forward)
        return self._wrapper

    def _forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self._abandoned:
            return module(*args, **kwargs)  # the step is dropped: no collective, any output
        replica = self.replicas.wrap(module)
        if replica is not module:
            # Gradients are all-reduced once per step, with the last micro-batch (what
            # DDP's no_sync() does, which must enclose the forward too).
            replica.require_backward_grad_sync = self._last_micro()  # type: ignore[assignment]
        if self._inplace is None:
            return replica(*args, **kwargs)
        try:
            return replica(*args, **kwargs)
        except Exception as exc:
            self._abandon_or_raise(exc)
            return module(*args, **kwargs)

    def _last_micro(self) -> bool:
        index, count = self._micro
        return index == count - 1

    @property
    def at_step_end(self) -> bool:
        """The managed way: whether the current micro-batch is its step's last (the step
        completes once its backward is done): the moment to log a step's loss."""
        return self._last_micro()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagates a micro-batch's *mean* loss, scaled for the global batch.

        The scale makes the accumulated, rank-averaged gradient the mean over the step's
        global batch on any world. A peer's failure during the gradient all-reduce abandons
        the step (the loop reconfigures before the next one) instead of failing the worker.
        """
        if self._abandoned:
            return
        if self._inplace is not None and self._last_micro():
            self._inplace.reached_collective()
        scaled = loss * self.plan.loss_scale_for(self._micro_size)
        if self._inplace is None:
            scaled.backward()  # type: ignore[no-untyped-call]
            return
        try:
            scaled.backward()  # type: ignore[no-untyped-call]
        except Exception as exc:
            self._abandon_or_raise(exc)

    def batches(self) -> Iterator[Any]:
        """Yields every micro-batch of every step still to run, moved to the device.

        After a step's last micro-batch the loop clips (``max_grad_norm``), steps the
        optimizer and scheduler, and closes the step (cursor, saves, drain agreement).
        """
        if self._data is None or self.optimizer is None:
            raise ConfigError("loop.batches() needs the managed loop; pass model=, optimizer= "
                              "and data= to ElasticLoop.")
        entered = not self._restored
        if entered:
            self.__enter__()
        try:
            for _step in self:
                self._declare()
                loader = self._managed_loader()
                self._audit_world(_step)
                with self.step_guard():
                    for batch in self.micro_batches(loader):
                        if self._audit is not None:
                            ids, batch = batch
                            self._audit.batch(generation=self._generation(), step=_step,
                                              rank=self._rank(), ids=ids)
                        yield to_device(batch, self.ctx.device if self.ctx else
                                        torch.device("cpu"))
                        if self._abandoned:
                            break
                    if not self._abandoned:
                        self._optimizer_step()
                        if self._audit is not None:
                            self._audit.done(generation=self._generation(), step=_step,
                                             rank=self._rank(), world=self.plan.world_size)
                        self.end_step()
        finally:
            if entered:
                self.close(wait=True)

    def _managed_loader(self) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        loader = self._loader
        if loader is None or self._batches is None:
            # A new world or a restore: the batch sampler snapshots the cursor and the split.
            data, options = self._data, dict(self._loader_options)
            if self._audit is not None:  # the indices travel with the samples
                data = IndexedDataset(data)
                options["collate_fn"] = IndexedCollate(options.get("collate_fn"))
            loader = DataLoader(data, batch_sampler=self.batch_sampler(), **options)
            self._loader = loader
        return loader

    def _generation(self) -> int:
        return self.ctx.generation if self.ctx is not None else 0

    def _audit_world(self, step: int) -> None:
        if self._audit is None:
            return
        heal = getattr(self._inplace, "last_heal", None) if self._inplace else None
        self._audit.world(generation=self._generation(), rank=self._rank(),
                          world=self.plan.world_size, step=step,
                          storage_loads=self.storage_loads,
                          received=bool(heal and heal.received),
                          source=heal.source if heal else -1)

    def _optimizer_step(self) -> None:
        assert self.optimizer is not None and self._module is not None
        if self._max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self._module.parameters(), self._max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

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

    def restore_from_storage(self) -> int:
        """Loads the newest committed checkpoint (or starts fresh); returns the next step."""
        self._restored = True
        self.has_state = True
        if self.checkpoint is None:
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
        self._record("restored", round=self._round, step=self.step, found=info is not None,
                     duration_s=round(time.monotonic() - started, 4))
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
        if self._install_signal_handler:
            self._drain.install()
        if not self._restored:
            self.restore()
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
        if self.checkpoint is not None:
            self.checkpoint.close(wait=wait)
        if self._inplace is not None:
            self._inplace.finish(self.step, finished=self.finished)

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

    # -- in-place reconfiguration (see elastic.inplace) -------------------------------------

    def heal_state(self) -> dict[str, Any]:
        """Everything a survivor sends a rank that is behind (the checkpointed state)."""
        return self._full_state()

    def world_changed(self) -> None:
        """Re-plans the batch and re-shards the data for the context's current world."""
        self.has_state = True
        world = self.ctx.world_size if self.ctx is not None else 1
        rank = self.ctx.rank if self.ctx is not None else 0
        self._round = self.ctx.round if self.ctx is not None else None
        self.plan = plan_batches(self.global_batch_size,
                                 self._requested_micro or self.global_batch_size, world)
        if self.sampler is not None:
            self.sampler.reshard(rank, world)
        self._batches = None
        self._flags = None  # the agreement runs on the new world's group
        if self.checkpoint is not None and self.ctx is not None:
            self.checkpoint.rebind(self.ctx.checkpoint_group, self.ctx.round)

    def _declare(self) -> None:
        if self._inplace is not None:
            self._inplace.declare(self.global_batch_size)

    @contextlib.contextmanager
    def step_guard(self) -> Iterator[None]:
        """Wraps a step's body (the explicit way): in place, a peer's failure abandons the
        step instead of failing the process, and the loop reconfigures before the next step.
        Without in-place reconfiguration it does nothing. Entering it declares the script
        in-place capable."""
        if self._inplace is None:
            yield
            return
        self._declare()
        try:
            yield
        except Exception as exc:
            self._abandon_or_raise(exc)

    def _abandon_or_raise(self, exc: BaseException) -> None:
        """Abandons the step if ``exc`` is a peer's failure (membership says so), else raises."""
        if self._abandoned:
            return
        if not (self._inplace is not None and self._inplace.in_place()
                and self._inplace.confirm_peer_failure(exc)):
            raise exc
        self._abandoned = True
        self._batches = None
        self._step_started = None
        self._flags = None
        for entry in (*self._user_state.values(), *self.replicas.modules()):
            module = getattr(entry, "model", entry)
            if isinstance(module, nn.Module):
                module.zero_grad(set_to_none=True)  # the step's partial gradients
        # Every survivor records it (rank 0 may be the one that died); the report takes the
        # first, as the moment the failure was noticed.
        self._events.record("peer_failed", step=self.step,
                            error=str(exc).splitlines()[0][:200] if str(exc) else "")
        self._inplace.abandon(exc, self.step)

    def data_parallel(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """``DistributedDataParallel(model)`` on the current world, rebuilt when it changes
        (the explicit way: call it inside each step; it is cached per world)."""
        return self.replicas.wrap(model, **kwargs)

    def settle_save(self) -> None:
        """Waits for the save in flight to commit, and for the step agreement in flight
        (before a planned world change tears the groups down)."""
        self.saves.settle(self.step, self._round)
        self.settle_collectives()

    def settle_collectives(self) -> None:
        """Waits for the boundary agreement in flight (its group is about to go)."""
        flags, self._flags = self._flags, None
        if flags is not None:
            flags.flush()

    # -- steps ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """Yields the index of each step still to run; stops at ``max_steps`` or a drain."""
        if not self._restored:
            self.restore()
        while True:
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
        if drain:
            self._drained = True
        self.saves.after_step(self.step, self._full_state(),
                              last=self.step >= self.max_steps, drained=drain,
                              round_=self._round)
        if drain:
            logger.info("drained at step %d", self.step)
            _tell_agent("drained", step=self.step)
        if started is not None:
            compute = max(0.0, time.monotonic() - started - self.saves.blocked_s)
            if self._inplace is not None:
                self._inplace.step_completed(self.step - 1, compute)
            elif time.monotonic() - self._progress_told >= _PROGRESS_EVERY_S:
                # The agent tells a node cut off from the job from a job-wide etcd outage by
                # whether its workers still train (in place the controller reports steps).
                self._progress_told = time.monotonic()
                _tell_agent("progress", step=self.step)
            # The step's compute and its agreement; checkpoint stalls are their own events.
            self._record("step", round=self._round, step=self.step - 1,
                         duration_s=round(compute, 4),
                         world=self.ctx.world_size if self.ctx is not None else 1)

    def _agree(self) -> bool:
        """This step's flags go out; the previous step's, agreed by every rank, come back."""
        newer = self._inplace is not None and self._inplace.change_pending()
        flags = [self._drain.requested, newer]
        if self.ctx is None or self.ctx.world_size == 1:
            agreed: tuple[bool, ...] | None = tuple(flags)
        else:
            if self.step >= self.max_steps:
                # The last step: start nothing new (no collective may outlive the loop).
                self.settle_collectives()
                return False
            if self._flags is None:
                self._flags = BoundaryFlags(2, self.ctx.device, self.ctx.process_group)
            agreed = self._flags.exchange(flags)
            if self._inplace is not None:
                self._inplace.check_agreement()  # NCCL: flags of an aborted world are garbage
        if agreed is None:
            return False
        if agreed[_NEWER_WORLD] and self._inplace is not None:
            self._inplace.request("membership")
        return bool(agreed[_DRAIN])

    def _record(self, event: str, **fields: Any) -> None:
        """Records an event: every rank's reaches its agent's metrics; the job's log keeps
        global rank 0's (durable): one copy per step (the steps are collective)."""
        self._events.record(event, durable=self.ctx is None or self.ctx.rank == 0, **fields)


class _StepBatches:
    """A re-iterable batch sampler: each pass starts at the sampler's cursor, under the
    loop's plan of that moment (the world may have changed since the loader was built)."""

    def __init__(self, sampler: ElasticSampler, plan: Callable[[], BatchPlan]) -> None:
        self._sampler, self._plan = sampler, plan

    def __iter__(self) -> Iterator[list[int]]:
        return self._sampler.micro_batches(self._plan())


def _tell_agent(kind: str, **fields: Any) -> None:
    """Sends a message to the node agent when elastic-run runs this worker (else nothing)."""
    from elastic.agent_link import current_link

    link = current_link()
    if link is not None:
        link.send(kind, **fields)

