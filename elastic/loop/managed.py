"""The managed way: the loop owns the model wrapper, the optimizer step and the data.

:class:`ManagedWay` is the part of :class:`~elastic.loop.ElasticLoop` behind ``model=``,
``optimizer=`` and ``data=``: ``loop.batches()`` yields every micro-batch of every step,
``loop.model`` runs DDP on the current world, ``loop.backward()`` scales the loss, and every
collective of a step happens inside one of these calls, so that a peer's failure abandons the
step wherever it strikes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastic.batching import BatchPlan
from elastic.loop.abandoned import AbandonedOutput, abandoned_output
from elastic.loop.audit import SampleAudit
from elastic.loop.replicas import ElasticModel, Replicas, to_device
from elastic_errors import ConfigError

if TYPE_CHECKING:
    from elastic.context import ElasticContext
    from elastic.sharded.model import ShardedTraining

__all__ = ["ManagedWay"]


class ManagedWay:
    """The managed way of :class:`~elastic.loop.ElasticLoop`."""

    ctx: ElasticContext | None
    plan: BatchPlan
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    replicas: Replicas
    _module: nn.Module | None
    _max_grad_norm: float | None
    _data: Any
    _loader_options: dict[str, Any]
    _loader: Iterable[Any] | None
    _batches: Iterator[Any] | None
    _inplace: Any
    _abandoned: bool
    _restored: bool
    _micro_size: int
    _audit: SampleAudit | None
    _wrapper: ElasticModel | None
    _sharded: ShardedTraining | None

    if TYPE_CHECKING:
        def __enter__(self) -> Any: ...
        def __iter__(self) -> Iterator[int]: ...
        def close(self, wait: bool = True) -> None: ...
        def end_step(self) -> None: ...
        def step_guard(self) -> Any: ...
        def micro_batches(self, loader: Iterable[Any],
                          model: nn.Module | None = None) -> Iterator[Any]: ...
        def batch_sampler(self) -> Iterable[list[int]]: ...
        def _abandon_or_raise(self, exc: BaseException) -> None: ...
        def _declare(self) -> None: ...
        def _last_micro(self) -> bool: ...
        def _rank(self) -> int: ...
        def _generation(self) -> int: ...
        def _audit_world(self, step: int) -> None: ...

    @property
    def model(self) -> nn.Module:
        """The managed model: call it like the model; it runs DDP on the current world (with
        ``parallelize``: the current world's sharded model)."""
        if self._wrapper is None:
            if self._sharded is not None:
                self._wrapper = ElasticModel(None, self._forward_sharded)
            elif self._module is None:
                raise ConfigError("loop.model needs the managed loop; pass model=, optimizer= "
                                  "and data= to ElasticLoop.")
            else:
                self._wrapper = ElasticModel(self._module, self._forward)
        return self._wrapper

    def _forward_sharded(self, _module: None, *args: Any, **kwargs: Any) -> Any:
        if self._abandoned:
            return abandoned_output()  # its forward is collectives: it cannot run alone
        assert self._sharded is not None
        module = self._sharded.require().module
        if self._inplace is None:
            return module(*args, **kwargs)
        self._inplace.reached_collective()  # FSDP gathers parameters in every forward
        try:
            return module(*args, **kwargs)
        except Exception as exc:
            self._abandon_or_raise(exc)
            return abandoned_output()

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

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagates a micro-batch's *mean* loss, scaled for the global batch.

        The scale makes the accumulated, rank-averaged gradient the mean over the step's
        global batch on any world. A peer's failure during the gradient all-reduce abandons
        the step (the loop reconfigures before the next one) instead of failing the worker.
        """
        if self._abandoned or isinstance(loss, AbandonedOutput):
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
        if self._data is None or (self.optimizer is None and self._sharded is None):
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
        from elastic.loop.data import managed_loader

        loader = self._loader
        if loader is None or self._batches is None:
            # A new world or a restore: the loader snapshots the cursor and the split.
            loader = managed_loader(self._data, self.plan, self.batch_sampler,
                                    self._loader_options, with_ids=self._audit is not None)
            self._loader = loader
        return loader

    def _optimizer_step(self) -> None:
        module = (self._sharded.require().module if self._sharded is not None
                  else self._module)
        assert self.optimizer is not None and module is not None
        if self._max_grad_norm is not None:
            nn.utils.clip_grad_norm_(module.parameters(), self._max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
