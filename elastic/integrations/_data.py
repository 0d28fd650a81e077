"""The data of a framework-driven job: a fixed global batch, each sample of each epoch exactly
once, on whatever world the job restarts in.

The frameworks iterate a ``DataLoader`` and step the optimizer every ``A`` batches
(gradient accumulation). :class:`StepBatches` is that loader's batch sampler: an endless
stream in which optimizer step ``s`` trains positions ``[s * G, (s + 1) * G)`` of the seeded
epoch orders (:class:`~elastic.sampler.ElasticSampler` in stream mode), rank ``r`` of ``W``
taking its share of them (shares differ by at most one sample) in ``A`` micro-batches. The
stream position after ``s`` steps is ``s * G`` whatever the worlds before were, so a job that
resumes at step ``s`` on another world trains exactly the samples an undisturbed job would.

Each micro-batch's loss (a *mean* over its ``m`` samples) is multiplied by
:meth:`StepBatches.loss_factor`, ``W * A * m / G``: the frameworks divide it by ``A`` and DDP
averages over the ``W`` ranks, so the gradient is the mean over the step's ``G`` samples,
exactly, however unevenly the world splits the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from elastic.batching import plan_batches
from elastic.sampler import ElasticSampler
from elastic_errors import ConfigError

__all__ = ["StepBatches", "even_split"]


def even_split(share: int, count: int) -> tuple[int, ...]:
    """``share`` samples in ``count`` micro-batches whose sizes differ by at most one."""
    base, extra = divmod(share, count)
    return tuple(base + (1 if j < extra else 0) for j in range(count))


class StepBatches:
    """A batch sampler of this rank's micro-batches, step after step (see the module doc).

    Args:
        dataset_size: Samples in the dataset.
        global_batch_size: Samples per optimizer step over all ranks (fixed for the job).
        rank: This worker's global rank.
        world_size: Ranks of this world.
        micro_batch_sizes: This rank's micro-batch sizes in one step (their sum is its share;
            every rank has as many).
        seed: Seed of the epoch orders.
        shuffle: Permute each epoch (else the dataset's order).
        drop_last: Never let a step straddle two epochs (the last ``dataset_size % G``
            positions of each epoch are left out).

    Raises:
        ConfigError: If the sizes do not add up to this rank's share.
    """

    def __init__(self, dataset_size: int, *, global_batch_size: int, rank: int,
                 world_size: int, micro_batch_sizes: Sequence[int], seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> None:
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        # One "micro-batch" per step holding the whole share: this class splits it.
        self.plan = plan_batches(global_batch_size, global_batch_size, world_size)
        self.micro_batch_sizes = tuple(micro_batch_sizes)
        share = self.plan.share(rank)
        if sum(self.micro_batch_sizes) != share or min(self.micro_batch_sizes) < 1:
            raise ConfigError(
                f"micro-batches {self.micro_batch_sizes} must be positive and add up to rank "
                f"{rank}'s share ({share} of the global batch {global_batch_size} on "
                f"{world_size} ranks); use fewer accumulation steps or a larger global batch."
            )
        self.sampler = ElasticSampler(dataset_size, seed=seed, shuffle=shuffle,
                                      drop_last=drop_last, rank=rank, world_size=world_size)
        self.sampler.set_global_batch_size(global_batch_size)
        self._at_step = 0

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step."""
        return len(self.micro_batch_sizes)

    @property
    def step(self) -> int:
        """The step the next pass starts at."""
        return self._at_step

    def loss_factor(self, micro_index: int) -> float:
        """The factor for the mean loss of micro-batch ``micro_index`` of a step."""
        size = self.micro_batch_sizes[micro_index % self.accumulation]
        return self.world_size * self.accumulation * size / self.global_batch_size

    def seek(self, step: int) -> None:
        """Puts the cursor after ``step`` optimizer steps (where a resumed job goes on)."""
        if step < 0:
            raise ValueError(f"step ({step}) must be non-negative.")
        state = self.sampler.state_dict()
        self.sampler.load_state_dict({**state, "epoch": 0, "consumed": 0})
        self.sampler.advance(step * self.global_batch_size)
        self._at_step = step

    def advance(self) -> None:
        """Moves the cursor past one optimizer step."""
        self.sampler.advance(self.global_batch_size)
        self._at_step += 1

    def __iter__(self) -> Iterator[list[int]]:
        """From the cursor (taken now): the step's share, in the step's micro-batches."""
        cuts = [0]
        for size in self.micro_batch_sizes:
            cuts.append(cuts[-1] + size)
        for share in self.sampler.micro_batches(self.plan):
            for lo, hi in itertools.pairwise(cuts):
                yield share[lo:hi]
