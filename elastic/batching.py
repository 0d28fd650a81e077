"""Batch plans: a fixed global batch split over any world size, in micro-batches.

A spot cluster spends most of its life at world sizes that do not divide the global batch
(3, 5, 6, 7 nodes ...), so nothing here requires that they do. For a global batch ``G`` on
``W`` ranks:

* **Shares** differ by at most one sample: ranks ``r < G % W`` train ``ceil(G / W)``
  samples per step, the others ``floor(G / W)``. Within a step, rank ``r`` takes the step's
  positions ``j`` with ``j % W == r`` (:class:`~elastic.sampler.ElasticSampler`).
* **Micro-batches**: every rank runs the *same number* ``k`` of micro-batches per step, the
  fewest that keep them at most the requested size ``m``: ``k = ceil(ceil(G / W) / m)``. They
  are all of size ``m`` but the last, which holds the rest; only when a rank's share leaves
  its last micro-batch empty do its last two split one sample off (``..., m - 1, 1``). Equal
  counts matter: DDP broadcasts buffers (BatchNorm's) in every forward, and SyncBatchNorm
  gathers in every forward, so ranks with different numbers of forwards would deadlock. A
  prime share never falls back to micro-batches of 1. (Micro-batches of one sample are the
  exception: a rank with a smaller share then runs one forward fewer.)
* **Loss scaling**: a micro-batch of ``c`` samples whose loss is a *mean* over them is
  multiplied by ``c * W / G`` (:meth:`BatchPlan.loss_scale_for`) before ``backward()``; after
  DDP averages over the ``W`` ranks, the gradient is exactly the mean over the step's ``G``
  samples, whatever the split.
* ``W > G`` would leave ranks without a sample: it is refused, and the world is capped at
  ``G`` workers instead (the rest wait as spares).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

from elastic_errors import ConfigError

__all__ = ["BatchPlan", "plan_batches"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class BatchPlan:
    """How one optimizer step of ``global_batch_size`` samples is split over a world.

    Attributes:
        global_batch_size: Samples per optimizer step over all ranks (never changed).
        requested_micro_batch_size: The largest micro-batch the user allows (memory bound).
        world_size: Number of data-parallel ranks.
    """

    global_batch_size: int
    requested_micro_batch_size: int
    world_size: int

    def __post_init__(self) -> None:
        for name, value in (("global_batch_size", self.global_batch_size),
                            ("micro_batch_size", self.requested_micro_batch_size),
                            ("world_size", self.world_size)):
            if value < 1:
                raise ConfigError(f"{name} ({value}) must be a positive integer.")
        if self.world_size > self.global_batch_size:
            raise ConfigError(
                f"world size ({self.world_size}) is larger than the global batch size "
                f"({self.global_batch_size}), which would leave ranks without a sample; "
                "use a larger global batch (the extra workers otherwise wait as spares)."
            )

    def share(self, rank: int) -> int:
        """Samples ``rank`` trains per step (shares differ by at most one)."""
        base, extra = divmod(self.global_batch_size, self.world_size)
        return base + (1 if rank < extra else 0)

    @cached_property
    def micro_batch_size(self) -> int:
        """The largest micro-batch of this world: what a ``DataLoader`` batches by."""
        return min(self.requested_micro_batch_size, self.share(0))

    @cached_property
    def grad_accum_steps(self) -> int:
        """Micro-batches per step, the same on every rank."""
        return -(-self.share(0) // self.micro_batch_size)

    def micro_batch_sizes(self, rank: int) -> tuple[int, ...]:
        """The sizes of ``rank``'s micro-batches in one step (``grad_accum_steps`` of them)."""
        share, size, count = self.share(rank), self.micro_batch_size, self.grad_accum_steps
        sizes = [size] * (count - 1) + [share - size * (count - 1)]
        if sizes[-1] < 1:  # one sample less than a full last batch: split one off
            if sizes[-2] > 1:
                sizes[-2] -= 1
                sizes[-1] = 1
            else:  # micro-batches of one sample: this rank has one forward fewer
                sizes.pop()
        return tuple(sizes)

    @property
    def even(self) -> bool:
        """Whether every micro-batch of every rank has :attr:`micro_batch_size` samples."""
        return (self.global_batch_size % self.world_size == 0
                and self.share(0) % self.micro_batch_size == 0)

    def loss_scale_for(self, count: int) -> float:
        """The factor for a micro-batch of ``count`` samples whose loss is their mean."""
        return count * self.world_size / self.global_batch_size

    @property
    def loss_scale(self) -> float:
        """The factor of a full micro-batch (``micro_batch_size`` samples)."""
        return self.loss_scale_for(self.micro_batch_size)

    @property
    def samples_per_rank(self) -> int:
        """The largest share (all shares are equal when :attr:`even`)."""
        return self.share(0)


def plan_batches(global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchPlan:
    """Plans micro-batches and gradient accumulation for a fixed global batch.

    Args:
        global_batch_size: Samples per optimizer step over all ranks.
        micro_batch_size: Largest micro-batch a rank may run (memory bound).
        world_size: Number of data-parallel ranks (at most the global batch).

    Returns:
        The plan (see the module docstring).

    Raises:
        ConfigError: If a value is not positive or the world is larger than the batch.
    """
    plan = BatchPlan(global_batch_size=global_batch_size,
                     requested_micro_batch_size=micro_batch_size, world_size=world_size)
    if plan.micro_batch_size != micro_batch_size or not plan.even:
        logger.info("global batch %d on %d ranks: shares %d-%d, %d micro-batches of up to %d",
                    global_batch_size, world_size, plan.share(world_size - 1), plan.share(0),
                    plan.grad_accum_steps, plan.micro_batch_size)
    return plan
