"""Batch plans: a fixed global batch split into micro-batches and gradient accumulation.

Rule for world sizes that do not divide the batch: the global batch is never changed. Each
rank trains ``global_batch_size / world_size`` samples per optimizer step, so the world size
must divide the global batch; the micro-batch is the largest size not above the requested one
that divides that per-rank share, and the rest is gradient accumulation. If the world size does
not divide the global batch, :func:`plan_batches` raises :class:`~elastic.errors.ConfigError`
naming the global batch, the micro-batch and the world size, and suggesting the nearest world
sizes that do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from elastic_errors import ConfigError

__all__ = ["BatchPlan", "plan_batches"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class BatchPlan:
    """How one optimizer step of ``global_batch_size`` samples is split over the world.

    Attributes:
        global_batch_size: Samples per optimizer step over all ranks (never changed).
        micro_batch_size: Samples per forward/backward pass on one rank.
        requested_micro_batch_size: The micro-batch the user asked for (an upper bound).
        world_size: Number of data-parallel ranks.
        grad_accum_steps: Forward/backward passes per rank per optimizer step.
        samples_per_rank: Samples one rank trains per optimizer step.
        loss_scale: Multiply each micro-batch's mean loss by this before ``backward()`` so
            that, after DDP averages gradients over ranks, the gradient is the mean over the
            global batch. Equal to ``1 / grad_accum_steps``.
    """

    global_batch_size: int
    micro_batch_size: int
    requested_micro_batch_size: int
    world_size: int
    grad_accum_steps: int
    samples_per_rank: int
    loss_scale: float

    def __post_init__(self) -> None:
        if (
            self.world_size * self.samples_per_rank != self.global_batch_size
            or self.micro_batch_size * self.grad_accum_steps != self.samples_per_rank
            or self.micro_batch_size > self.requested_micro_batch_size
        ):
            raise ConfigError(f"inconsistent batch plan ({self!r}); build it with plan_batches().")


def _nearest_divisors(value: int, around: int) -> list[int]:
    divisors = [d for d in range(1, value + 1) if value % d == 0]
    below = [d for d in divisors if d < around]
    above = [d for d in divisors if d > around]
    return below[-1:] + above[:1]


def plan_batches(global_batch_size: int, micro_batch_size: int, world_size: int) -> BatchPlan:
    """Plans micro-batches and gradient accumulation for a fixed global batch.

    Args:
        global_batch_size: Samples per optimizer step over all ranks.
        micro_batch_size: Largest micro-batch a rank may run (memory bound).
        world_size: Number of data-parallel ranks.

    Returns:
        The plan; ``micro_batch_size`` may be smaller than requested (logged), the global
        batch never differs.

    Raises:
        ConfigError: If a value is not positive or ``world_size`` does not divide
            ``global_batch_size``.
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("world_size", world_size),
    ):
        if value < 1:
            raise ConfigError(f"{name} ({value}) must be a positive integer.")
    if global_batch_size % world_size != 0:
        suggestions = " or ".join(str(d) for d in _nearest_divisors(global_batch_size, world_size))
        raise ConfigError(
            f"global batch size ({global_batch_size}) with micro batch size "
            f"({micro_batch_size}) cannot be split evenly over world size ({world_size}); "
            f"run on a world size that divides the global batch (e.g. {suggestions}) or "
            "change the global batch size."
        )
    samples_per_rank = global_batch_size // world_size
    micro = min(micro_batch_size, samples_per_rank)
    while samples_per_rank % micro != 0:
        micro -= 1
    if micro != micro_batch_size:
        logger.info(
            "micro batch %d instead of %d so that %d ranks x micro x accumulation = %d",
            micro,
            micro_batch_size,
            world_size,
            global_batch_size,
        )
    accum = samples_per_rank // micro
    return BatchPlan(
        global_batch_size=global_batch_size,
        micro_batch_size=micro,
        requested_micro_batch_size=micro_batch_size,
        world_size=world_size,
        grad_accum_steps=accum,
        samples_per_rank=samples_per_rank,
        loss_scale=1.0 / accum,
    )
