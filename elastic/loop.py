"""``ElasticLoop``: resume, fixed global batch, periodic checkpoints and SIGTERM drain.

The user's loop stays a plain PyTorch loop; the object only decides *which* step runs next,
how a step is split into micro-batches on the current world, and when state is saved::

    with elastic.ElasticLoop(ctx, state=..., checkpoint=mgr, sampler=sampler, max_steps=1000,
                             checkpoint_interval=100, global_batch_size=256,
                             micro_batch_size=32) as loop:
        loader = DataLoader(dataset, batch_size=loop.micro_batch_size, sampler=sampler)
        for step in loop:
            for x, y in loop.micro_batches(loader, model):
                loop.scale_loss(loss_fn(model(x), y)).backward()
            optimizer.step(); optimizer.zero_grad()
            loop.end_step()

Guarantees (restart-based path):

* Entering the loop loads the newest committed checkpoint (user state, step, sampler cursor,
  RNG) or starts fresh; a checkpoint that does not fit the state is a :class:`ConfigError`
  raised before anything is written.
* Step ``s`` always trains stream positions ``[s * G, (s + 1) * G)`` of the sampler's epoch
  orders (``G`` the global batch), split over whatever world exists, and the gradient is the
  mean over those ``G`` samples, so the optimisation does not depend on the world size.
* Lost work is bounded: a failure rolls back to the newest *committed* checkpoint, so the
  steps a rank had completed since then are redone, at most
  ``checkpoint_interval + max_commit_lag`` of them (plus the step in flight, which was never
  completed). Saves are asynchronous: a save started after step ``s`` commits while steps
  ``s + 1, ...`` train, and until it has committed a failure falls back to the save before it.
  The loop waits for each save's commit at the latest ``max_commit_lag`` steps after starting
  it (default ``checkpoint_interval``, where the next save would wait for it anyway, so
  steady-state training never blocks unless persisting is slower than an interval: the bound
  is two intervals). ``max_commit_lag=0`` waits for every commit before the next step: at most
  one interval is lost, at the price of the persist time on the training thread. A save that
  fails to commit (a storage error) is logged and training goes on; the bound then counts from
  the last save that did commit.
* SIGTERM sets a drain flag; all ranks agree on it at the next step boundary (a one-element
  all-reduce), save that step, wait for the commit up to ``drain_timeout`` and stop iterating.
  torchrun's agent (and so elastic-run's) signals the worker's whole process group, which
  includes ``DataLoader`` worker processes; those exit on a SIGTERM that does not come from
  their parent, and the main process then fails with "DataLoader worker ... is killed by
  signal: Terminated" instead of draining. :meth:`ElasticLoop.micro_batches` therefore makes
  the loader's workers ignore SIGTERM (wrapping its ``worker_init_fn``); they still stop when
  the main process shuts the loader down, and die with it on SIGKILL.

Every rank records ``step`` (compute time of each step), ``checkpoint`` (time the training
thread was blocked by a save or a commit wait) and ``restored`` (time spent loading the
checkpoint) events (:mod:`elastic.eventlog`): each reaches its node agent's metrics, and global
rank 0's reach the job event log (``--events-dir``), from which ``elastic-run goodput`` splits
the wall time.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader

from elastic.batching import BatchPlan, plan_batches
from elastic.errors import ConfigError
from elastic.eventlog import EventLog

if TYPE_CHECKING:
    from checkpointing import CheckpointManager, SaveHandle
    from elastic.context import ElasticContext
    from elastic.sampler import ElasticSampler

__all__ = ["ElasticLoop"]

logger = logging.getLogger(__name__)

_LOOP_KEY = "elastic"


class _LoopState(Stateful):
    """Step, sampler cursor, global batch and RNG state, saved under ``"elastic"``."""

    def __init__(self, loop: ElasticLoop) -> None:
        self._loop = loop

    def state_dict(self) -> dict[str, Any]:
        loop = self._loop
        state: dict[str, Any] = {
            "step": loop.step,
            "global_batch_size": loop.global_batch_size,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda_rng"] = torch.cuda.get_rng_state()
        if loop.sampler is not None:
            state["sampler"] = loop.sampler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loop._apply_loaded(state_dict)


class _IgnoreSigterm:
    """A ``DataLoader`` ``worker_init_fn`` that ignores SIGTERM, then runs the user's one.

    A class rather than a closure so that it pickles for ``spawn``/``forkserver`` workers.
    """

    def __init__(self, inner: Callable[[int], None] | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        # Runs after torch's own worker signal set-up, which makes a foreign SIGTERM fatal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def _shield_workers_from_sigterm(loader: Iterable[Any]) -> None:
    if not isinstance(loader, DataLoader) or loader.num_workers == 0:
        return
    if not isinstance(loader.worker_init_fn, _IgnoreSigterm):
        loader.worker_init_fn = _IgnoreSigterm(loader.worker_init_fn)


class ElasticLoop:
    """Drives the steps of an elastic job; see the module docstring for an example.

    Args:
        ctx: The context from :func:`elastic.init` (``None``: single process, no groups).
        state: What to checkpoint besides the loop's own state: ``Stateful`` objects (e.g.
            ``ModelOptimizerState``, an LR scheduler), tensors or dicts.
        checkpoint: The manager to save to and restore from (``None``: no checkpoints).
        sampler: The data sampler; the loop switches it to a stream of fixed global batches,
            re-shards it to the world and saves its cursor.
        max_steps: Optimizer steps of the whole job.
        checkpoint_interval: Save every this many steps (and at the last step and on drain).
        max_commit_lag: Steps training may run past a save before the loop waits for it to
            commit, in ``[0, checkpoint_interval]``; ``None`` means ``checkpoint_interval``.
            A failure redoes at most ``checkpoint_interval + max_commit_lag`` completed steps
            (see the module docstring).
        global_batch_size: Samples per optimizer step over all ranks (fixed for the job).
        micro_batch_size: Largest per-rank forward/backward batch; ``None`` means no
            accumulation beyond what the world requires (the per-rank share).
        drain_timeout: How long a SIGTERM drain waits for its final checkpoint to commit.
        install_signal_handler: Install the SIGTERM drain handler (main thread only).

    Raises:
        ConfigError: On invalid values or a world that cannot split the global batch.
    """

    def __init__(
        self,
        ctx: ElasticContext | None,
        *,
        state: Mapping[str, Any],
        checkpoint: CheckpointManager | None,
        sampler: ElasticSampler | None,
        max_steps: int,
        checkpoint_interval: int,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        drain_timeout: timedelta = timedelta(seconds=25),
        install_signal_handler: bool = True,
        max_commit_lag: int | None = None,
    ) -> None:
        if max_steps < 0:
            raise ConfigError(f"max_steps ({max_steps}) must be non-negative.")
        if checkpoint_interval < 1:
            raise ConfigError(f"checkpoint_interval ({checkpoint_interval}) must be at least 1.")
        if max_commit_lag is None:
            max_commit_lag = checkpoint_interval
        if not 0 <= max_commit_lag <= checkpoint_interval:
            # Above the interval it would change nothing: the next save waits for this one.
            raise ConfigError(
                f"max_commit_lag ({max_commit_lag}) must be between 0 and checkpoint_interval "
                f"({checkpoint_interval}); pass None for the interval."
            )
        if _LOOP_KEY in state:
            raise ConfigError(f"state key ({_LOOP_KEY!r}) is reserved for the loop; rename it.")
        self.ctx = ctx
        self.checkpoint = checkpoint
        self.sampler = sampler
        self.max_steps = max_steps
        self.checkpoint_interval = checkpoint_interval
        self.max_commit_lag = max_commit_lag
        self.global_batch_size = global_batch_size
        self.drain_timeout = drain_timeout
        self._requested_micro = micro_batch_size
        self._user_state = dict(state)
        self._install_signal_handler = install_signal_handler
        world = ctx.world_size if ctx is not None else 1
        rank = ctx.rank if ctx is not None else 0
        self.plan: BatchPlan = plan_batches(
            global_batch_size, micro_batch_size or global_batch_size, world
        )
        if sampler is not None:
            sampler.reshard(rank, world)
            sampler.set_global_batch_size(global_batch_size)
        #: Completed optimizer steps; the index of the next step to run.
        self.step = 0
        #: Step the loop resumed from (0 on a fresh start).
        self.resumed_from = 0
        self._drain = threading.Event()
        self._drained = False
        self._saved_step = -1
        self._uncommitted: SaveHandle | None = None
        self._previous_handler: Any = None
        self._batches: Iterator[Any] | None = None
        self._loader: Iterable[Any] | None = None
        self._restored = False
        # In-place reconfiguration (elastic.inplace): the controller, when the job runs so.
        self._inplace: Any = getattr(ctx, "inplace", None)
        #: Whether this process holds the job's state (restored, healed or trained a step).
        self.has_state = False
        #: Times this process read a checkpoint from storage (in place: only with no survivor).
        self.storage_loads = 0
        self._abandoned = False
        self._batches_generation = ctx.generation if ctx is not None else 0
        self._data_parallel: dict[int, tuple[int, torch.nn.Module, torch.nn.Module]] = {}
        # One copy per job is enough for the goodput report (the steps are collective):
        # whoever is global rank 0 now writes it (in place, rank 0 may change with the world).
        self._events = EventLog.from_env()
        self._round = ctx.round if ctx is not None else None
        self._step_started: float | None = None
        self._blocked_s = 0.0  # checkpoint stalls of the step being closed

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
        """``loss * loss_scale`` (``loss`` is a micro-batch's mean loss)."""
        return loss * self.plan.loss_scale

    def micro_batches(
        self, loader: Iterable[Any], model: torch.nn.Module | None = None
    ) -> Iterator[Any]:
        """Yields this step's ``grad_accum_steps`` micro-batches from ``loader``.

        The loader's iterator is kept across steps (it is endless over the sampler's stream),
        so DataLoader workers are started once; they ignore SIGTERM (see the module
        docstring) so that a drain is not turned into a crash. With a DDP ``model``, all but
        the last micro-batch run under ``model.no_sync()``: gradients are all-reduced once per
        step. Call ``backward()`` before asking for the next micro-batch.

        Raises:
            ConfigError: If the loader's batch size is not :attr:`micro_batch_size`.
        """
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is not None and batch_size != self.plan.micro_batch_size:
            raise ConfigError(
                f"DataLoader batch_size ({batch_size}) differs from the micro batch of this "
                f"world ({self.plan.micro_batch_size}); build the loader with "
                "batch_size=loop.micro_batch_size."
            )
        generation = self.ctx.generation if self.ctx is not None else 0
        if (self._batches is None or self._loader is not loader
                or self._batches_generation != generation):
            self._batches_generation = generation
            self._loader = loader
            _shield_workers_from_sigterm(loader)
            self._batches = iter(loader)
        no_sync = getattr(model, "no_sync", None)
        for index in range(self.plan.grad_accum_steps):
            batch = next(self._batches)
            if no_sync is not None and index < self.plan.grad_accum_steps - 1:
                with no_sync():
                    yield batch
            else:
                yield batch

    # -- lifecycle --------------------------------------------------------------------------

    def _full_state(self) -> dict[str, Any]:
        return {**self._user_state, _LOOP_KEY: _LoopState(self)}

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
        self._record("restored", round=self._round, step=self.step,
                            found=info is not None,
                            duration_s=round(time.monotonic() - started, 4))
        if info is None:
            logger.info("fresh start: no committed checkpoint")
            return self.step
        self.resumed_from = self.step
        self._saved_step = self.step
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
        random.setstate(_as_python_rng(state["python_rng"]))
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])
        if self.sampler is not None:
            if "sampler" not in state:
                raise ConfigError(
                    "the checkpoint has no sampler cursor but this job has a sampler; start "
                    "it in a new checkpoint directory."
                )
            self.sampler.load_state_dict(state["sampler"])

    # -- in-place reconfiguration (see elastic.inplace) -------------------------------------

    def heal_state(self) -> dict[str, Any]:
        """Everything a survivor sends a rank that is behind (the checkpointed state)."""
        return self._full_state()

    def world_changed(self) -> None:
        """Re-plans the batch and re-shards the sampler for the context's current world."""
        self.has_state = True
        world = self.ctx.world_size if self.ctx is not None else 1
        rank = self.ctx.rank if self.ctx is not None else 0
        self._round = self.ctx.round if self.ctx is not None else None
        self.plan = plan_batches(self.global_batch_size,
                                 self._requested_micro or self.global_batch_size, world)
        if self.sampler is not None:
            self.sampler.reshard(rank, world)
        self._batches = None
        if self.checkpoint is not None and self.ctx is not None:
            self.checkpoint.rebind(self.ctx.checkpoint_group, self.ctx.round)

    @contextlib.contextmanager
    def step_guard(self) -> Iterator[None]:
        """Wrap each step's body: in place, a peer's death abandons the step instead of
        failing the process (the loop reconfigures before the next step). Without in-place
        reconfiguration it does nothing."""
        if self._inplace is None:
            yield
            return
        try:
            yield
        except Exception as exc:
            from elastic.inplace.controller import is_peer_failure

            if not is_peer_failure(exc):
                raise
            self._abandoned = True
            self._batches = None
            self._step_started = None
            for entry in (*self._user_state.values(),
                          *(m for _, m, _ in self._data_parallel.values())):
                module = getattr(entry, "model", entry)
                if isinstance(module, torch.nn.Module):
                    module.zero_grad(set_to_none=True)  # the step's partial gradients
            # Every survivor records it (rank 0 may be the one that died); the report takes
            # the first, as the moment the failure was noticed.
            self._events.record("peer_failed", step=self.step,
                                error=str(exc).splitlines()[0][:200])
            self._inplace.abandon(exc)

    def data_parallel(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """``DistributedDataParallel(model)`` on the current world, rebuilt when it changes.

        Call it inside each step (it is cached per world). Without a process group it returns
        ``model``. In place, every rank holds the same state after a heal, so DDP's initial
        broadcast is skipped.
        """
        if self.ctx is None or not dist.is_initialized():
            return model
        from torch.nn.parallel import DistributedDataParallel

        generation = self.ctx.generation
        cached = self._data_parallel.get(id(model))
        if cached is not None and cached[0] == generation:
            return cached[2]
        if self.ctx.device.type == "cuda":
            kwargs.setdefault("device_ids", [self.ctx.device])
        if self._inplace is not None:
            kwargs.setdefault("init_sync", False)
        wrapped = DistributedDataParallel(model, process_group=self.ctx.process_group, **kwargs)
        self._data_parallel[id(model)] = (generation, model, wrapped)
        return wrapped

    def __enter__(self) -> ElasticLoop:
        if self._install_signal_handler and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        if not self._restored:
            self.restore()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(wait=exc_type is None)

    def close(self, wait: bool = True) -> None:
        """Waits for the last save (when ``wait``), closes the manager, restores SIGTERM."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if self.checkpoint is not None:
            self.checkpoint.close(wait=wait)
        if self._inplace is not None:
            self._inplace.finish(self.step, finished=self.finished)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the save needs every rank, so it happens at an agreed step boundary.
        self._drain.set()

    def request_drain(self) -> None:
        """Asks the loop to save and stop at the next step boundary (what SIGTERM does)."""
        self._drain.set()

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
            if self._inplace is not None:
                self._inplace.before_step(self)  # a pending reconfiguration and heal
            if self.step >= self.max_steps or self._drained:
                return
            started = self.step
            self._step_started = time.monotonic()
            self._abandoned = False
            yield started
            if self.step == started and not self._abandoned:
                raise RuntimeError(
                    f"step ({started}) ended without loop.end_step(); call it after "
                    "optimizer.step()."
                )

    def end_step(self) -> None:
        """Closes the step: advances the sampler by the global batch, saves when due, and
        agrees with every rank on draining."""
        if self.sampler is not None:
            self.sampler.advance(self.global_batch_size)
        self.step += 1
        self.has_state = True
        started, self._step_started = self._step_started, None
        self._blocked_s = 0.0
        if self.ctx is not None:
            self.ctx.after_first_step()
        drain = self._agree_on_drain()
        self._await_overdue_commit()  # the previous save, before a new one replaces it
        if drain:
            self._drained = True
            self._save(final=True)
            logger.info("drained at step %d", self.step)
        elif self.step >= self.max_steps:
            self._save(final=True)
        elif self.step % self.checkpoint_interval == 0:
            self._save(final=False)
        self._await_overdue_commit()  # this step's save, when max_commit_lag is 0
        if started is not None:
            # The step's compute and its per-step agreement; checkpoint stalls are their own
            # events, so that the goodput report can tell them apart.
            self._record(
                "step", round=self._round, step=self.step - 1,
                duration_s=round(max(0.0, time.monotonic() - started - self._blocked_s), 4),
                world=self.ctx.world_size if self.ctx is not None else 1,
            )

    def _record(self, event: str, **fields: Any) -> None:
        """Records an event: every rank's reaches its agent's metrics; the job's log keeps
        global rank 0's (durable), one copy per step."""
        self._events.record(event, durable=self.ctx is None or self.ctx.rank == 0, **fields)

    def _agree_on_drain(self) -> bool:
        # One all-reduce agrees on a drain and, in place, on a membership change, so that
        # every rank acts at the same step boundary; one .tolist() is one device sync.
        flags = [self._drain.is_set(),
                 self._inplace is not None and self._inplace.boundary_flag()]
        if self.ctx is not None and self.ctx.world_size > 1:
            tensor = torch.tensor([float(f) for f in flags], device=self.ctx.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.ctx.process_group)
            flags = [value > 0 for value in tensor.tolist()]
        if flags[1] and self._inplace is not None:
            self._inplace.request("membership")
        return bool(flags[0])

    def settle_save(self) -> None:
        """Waits for the save in flight to commit (or fail), whatever its age.

        In place, called by every member of a world before a planned membership change tears
        its process groups down: the save's collectives run on those groups, so destroying
        them under it would fail the save (and a job with frequent changes would never
        commit one).
        """
        self._await_overdue_commit(force=True)

    def _await_overdue_commit(self, *, force: bool = False) -> None:
        """Waits for the in-flight save once it is ``max_commit_lag`` steps old.

        This is what bounds lost work (module docstring); every rank waits for its own handle,
        and the handles resolve together because the commit is one collective.
        """
        handle = self._uncommitted
        if handle is None or (not force and self.step - handle.step < self.max_commit_lag):
            return
        self._uncommitted = None
        if not handle.committed.done():
            started = time.monotonic()
            handle.committed.exception()
            waited = time.monotonic() - started
            logger.info(
                "waited %.2fs at step %d for the checkpoint of step %d to commit",
                waited, self.step, handle.step,
            )
            self._blocked_s += waited
            self._record("checkpoint", round=self._round, step=handle.step,
                         blocked_s=round(waited, 4), final=False, wait="commit")
        error = handle.committed.exception()
        if error is not None:
            logger.warning(
                "checkpoint of step %d did not commit (%s); until a later one does, a failure "
                "rolls back further than checkpoint_interval + max_commit_lag steps",
                handle.step, error,
            )

    def _save(self, *, final: bool) -> None:
        if self.checkpoint is None or self._saved_step == self.step:
            return
        self._saved_step = self.step
        started = time.monotonic()
        handle = self.checkpoint.save(self.step, self._full_state())
        # A final save does its own waiting (bounded by drain_timeout when draining).
        self._uncommitted = None if final else handle
        if final:
            timeout = self.drain_timeout.total_seconds() if self._drained else None
            with contextlib.suppress(Exception):
                handle.committed.result(timeout=timeout)
            if handle.committed.done() and handle.committed.exception() is None:
                logger.info(
                    "final checkpoint at step %d committed in %.2fs",
                    self.step, time.monotonic() - started,
                )
            else:
                logger.warning("final checkpoint at step %d did not commit in time", self.step)
        blocked = time.monotonic() - started
        self._blocked_s += blocked
        self._record("checkpoint", round=self._round, step=self.step,
                     blocked_s=round(blocked, 4), final=final)


def _as_python_rng(value: Any) -> tuple[Any, ...]:
    # DCP round-trips tuples as lists; random.setstate needs the original nesting.
    if isinstance(value, list):
        return tuple(_as_python_rng(v) if isinstance(v, list) else v for v in value)
    return tuple(value)
