"""The loop's side of in-place reconfiguration (:mod:`elastic.inplace`).

:class:`InPlaceHooks` is what the in-place controller calls on :class:`~elastic.loop.ElasticLoop`
(the state a survivor sends, the new world's plan, settling before a planned change) and what
turns a peer's failure inside a step into an abandoned step (``step_guard``) instead of a
failed worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from elastic.batching import BatchPlan, plan_batches
from elastic.boundary_flags import AgreementCadence, BoundaryFlags
from elastic.eventlog import EventLog
from elastic.loop.replicas import Replicas
from elastic.loop.saves import SaveSchedule

if TYPE_CHECKING:
    from checkpointing import CheckpointManager
    from elastic.context import ElasticContext
    from elastic.sampler import ElasticSampler

__all__ = ["InPlaceHooks"]


class InPlaceHooks:
    """The in-place hooks of :class:`~elastic.loop.ElasticLoop`."""

    ctx: ElasticContext | None
    plan: BatchPlan
    sampler: ElasticSampler | None
    checkpoint: CheckpointManager | None
    global_batch_size: int
    has_state: bool
    step: int
    saves: SaveSchedule
    replicas: Replicas
    _requested_micro: int | None
    _round: int | None
    _batches: Iterator[Any] | None
    _flags: BoundaryFlags | None
    _cadence: AgreementCadence
    _inplace: Any
    _abandoned: bool
    _step_started: float | None
    _user_state: dict[str, Any]
    _events: EventLog

    if TYPE_CHECKING:
        def _full_state(self) -> dict[str, Any]: ...
        def settle_collectives(self) -> None: ...

    def heal_state(self) -> dict[str, Any]:
        """Everything a survivor sends a rank that is behind (the checkpointed state)."""
        self.saves.wait_copy()  # a receiver's state must not change under a save's copy
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
        self._cadence.reset()
        if self.checkpoint is not None and self.ctx is not None:
            self.checkpoint.rebind(self.ctx.checkpoint_group, self.ctx.round)
        self.saves.reserve_due = True  # local shards may have new shapes

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
        self._cadence.reset()
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
