"""Micro-batching: how a step's global batch is split over this world's ranks and micro-batches.

:class:`MicroBatching` is the part of :class:`~elastic.loop.ElasticLoop` that plans a step's
data: the batch plan of the current world (:func:`~elastic.batching.plan_batches`), the loss
scale that makes the accumulated gradient the global batch's mean, and the explicit way's
micro-batches from a loader (the last one, alone, all-reduces the gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastic.batching import BatchPlan
from elastic.loop.signals import shield_workers_from_sigterm
from elastic_errors import ConfigError

if TYPE_CHECKING:
    from elastic.context import ElasticContext
    from elastic.sampler import ElasticSampler

__all__ = ["MicroBatching"]


class MicroBatching:
    """The batch plan and the micro-batches of :class:`~elastic.loop.ElasticLoop`."""

    ctx: ElasticContext | None
    plan: BatchPlan
    sampler: ElasticSampler | None
    global_batch_size: int
    _inplace: Any
    _batches: Iterator[Any] | None
    _loader: Iterable[Any] | None
    _batches_generation: int
    _micro: tuple[int, int]
    _micro_size: int

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
                if self._inplace is not None and not self._forward_collectives():
                    # The step's gradient collective comes with this micro-batch's backward:
                    # from here on this rank waits for its peers (the progress rule).
                    self._inplace.reached_collective()
                yield batch

    def _forward_collectives(self) -> bool:
        """Whether the managed model's forward itself runs collectives (a sharded model): it
        then marks the step's arrival at its collectives itself (the progress rule), when it
        runs, not when the script is handed the batch."""
        return getattr(self, "_sharded", None) is not None and \
            getattr(self, "_data", None) is not None

    def _last_micro(self) -> bool:
        index, count = self._micro
        return index == count - 1

    @property
    def at_step_end(self) -> bool:
        """The managed way: whether the current micro-batch is its step's last (the step
        completes once its backward is done): the moment to log a step's loss."""
        return self._last_micro()


class _StepBatches:
    """A re-iterable batch sampler: each pass starts at the sampler's cursor, under the
    loop's plan of that moment (the world may have changed since the loader was built)."""

    def __init__(self, sampler: ElasticSampler, plan: Callable[[], BatchPlan]) -> None:
        self._sampler, self._plan = sampler, plan

    def __iter__(self) -> Iterator[list[int]]:
        return self._sampler.micro_batches(self._plan())
