"""ElasticSampler: a rank-agnostic global cursor into a seeded per-epoch permutation.

The state that survives restarts and membership changes is only ``(epoch, consumed)`` plus the
identity of the permutation (``seed``, ``dataset_size``, ``shuffle``, ``order``). Each rank
derives its share of the *rest* of the epoch from that cursor and the current world, so any
sequence of re-shards and restores trains every sample of an epoch exactly once.

Each epoch's order is a seeded bijection on ``[0, dataset_size)`` (:mod:`elastic.permutation`):
a position is mapped to its index on its own, so nothing of the dataset's size is ever built,
and the sampler takes the same few kilobytes for a billion samples as for a thousand.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
from torch.utils.data import Sampler

from elastic.batching import BatchPlan
from elastic.permutation import (
    MAX_SIZE,
    ORDER,
    IdentityPermutation,
    Permutation,
    epoch_permutation,
)
from elastic_errors import ConfigError

__all__ = ["ElasticSampler", "PositionBatch"]

PositionBatch = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""``(epochs, positions)``: the epoch and the position in that epoch's order of each sample of a
batch (two int64 arrays of the batch's length, in stream order)."""

# torch's own launcher variables (not elastic-run's), read only when no process group exists.
_RANK_ENV = "RANK"
_WORLD_SIZE_ENV = "WORLD_SIZE"

_STATE_KEYS = ("epoch", "consumed", "seed", "dataset_size", "shuffle")
_SEQUENTIAL: Final = "sequential"
# What a state dict without an "order" key was written with: elastic-run's samplers before the
# constant-memory order drew every epoch with torch.randperm.
_LEGACY_ORDER: Final = "torch.randperm"
_CHUNK = 8192  # positions mapped per numpy call


def _default_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get(_RANK_ENV, "0")), int(os.environ.get(_WORLD_SIZE_ENV, "1"))


class ElasticSampler(Sampler[int]):
    """Yields this rank's share of the rest of the current epoch.

    Every epoch has one order: the seeded permutation
    ``elastic.permutation.epoch_permutation(dataset_size, seed, epoch)`` (or
    ``range(dataset_size)`` when ``shuffle`` is false), evaluated position by position in
    ``O(1)`` memory. The cursor
    ``consumed`` counts the real samples of that order already trained, globally. ``__iter__``
    takes ``rest = order[consumed:]``, makes its length a multiple of ``world_size`` (see the
    ``drop_last`` rule) and yields ``rest[rank::world_size]``. Because the split is strided,
    after each rank has taken ``b`` indices the ranks together have taken exactly
    ``rest[:b * world_size]``, so ``advance(b * world_size)`` moves the cursor past exactly the
    samples trained, whatever the world was, and the next world continues from there.

    ``drop_last`` rule:
        * ``drop_last=False``: the rest of the epoch is padded at its end, by repeating the
          first indices of the rest (cyclically), up to a multiple of ``world_size`` so that every
          rank gets the same count. Padding is at most ``world_size - 1`` positions, at most one
          per rank and always this rank's last index; :meth:`padding_count` says whether this
          rank's last index is padding so that audits can exclude it. ``advance`` counts real
          samples only: advancing by any count that reaches the end of the real samples
          finishes the epoch (``consumed == dataset_size``). Every sample of the epoch is
          trained exactly once, plus the marked padding.
        * ``drop_last=True``: the rest is truncated to a multiple of ``world_size``; the fewer
          than ``world_size`` indices at the end of the order that do not fill a whole round
          are not yielded in this world (a later, smaller world may still yield them). They
          are dropped, never trained, when the loop starts the next epoch with
          :meth:`set_epoch`; a loop with a fixed global batch does so as soon as
          :attr:`remaining` is below the global batch, so the dropped remainder is smaller
          than one global batch. No sample is ever trained twice, and the trained samples of
          an epoch are exactly ``order[:consumed]``.

    The sampler works with ``DataLoader`` workers: indices are produced in the main process,
    and ``__iter__`` snapshots its shard, so calling :meth:`advance` while a loader iterator is
    still prefetching does not change what that iterator yields. Indices are computed as they
    are consumed (a few thousand at a time): memory does not grow with ``dataset_size``.

    Args:
        dataset_size: Number of samples in the dataset.
        seed: Base seed of the per-epoch permutations; the same on every rank.
        shuffle: Whether to permute; when false the order is ``0 .. dataset_size - 1``.
        drop_last: Drop instead of pad the end of the epoch (see above).
        rank: This process's rank; defaults to the default process group's rank, else env
            ``RANK``, else 0.
        world_size: Number of ranks; defaults to the default process group's size, else env
            ``WORLD_SIZE``, else 1.

    Raises:
        ConfigError: If ``dataset_size`` is not positive, is smaller than ``world_size``, or
            ``rank`` is outside ``[0, world_size)``.
    """

    _STATE_SOURCE = "ElasticSampler.state_dict()"

    def __init__(
        self,
        dataset_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if not 1 <= dataset_size <= MAX_SIZE:
            raise ConfigError(
                f"dataset_size ({dataset_size}) must be between 1 and 2**62; pass len(dataset) "
                "of a non-empty dataset."
            )
        self._dataset_size = dataset_size
        self._seed = seed
        self._shuffle = shuffle
        self._drop_last = drop_last
        self._epoch = 0
        self._consumed = 0
        self._global_batch: int | None = None
        self._orders: dict[int, Permutation] = {}
        if rank is None or world_size is None:
            default_rank, default_world = _default_world()
            rank = default_rank if rank is None else rank
            world_size = default_world if world_size is None else world_size
        self._rank = 0
        self._world_size = 1
        self.reshard(rank, world_size)

    # -- cursor -----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Real samples of the current epoch already trained, over all ranks."""
        return self._consumed

    @property
    def remaining(self) -> int:
        """Real samples of the current epoch not yet trained, over all ranks."""
        return self._dataset_size - self._consumed

    @property
    def rank(self) -> int:
        """This sampler's rank in the current world."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks the rest of the epoch is split over."""
        return self._world_size

    @property
    def dataset_size(self) -> int:
        """Number of samples in the dataset."""
        return self._dataset_size

    def set_epoch(self, epoch: int) -> None:
        """Moves to ``epoch``; a different epoch starts at its beginning.

        Setting the current epoch again keeps the cursor, so the usual ``set_epoch(epoch)`` at
        the top of an epoch loop is safe after a mid-epoch restore.

        Raises:
            ValueError: If ``epoch`` is negative.
        """
        if epoch < 0:
            raise ValueError(f"epoch ({epoch}) must be non-negative.")
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def advance(self, num_global_samples: int) -> None:
        """Moves the cursor past the samples all ranks trained in one optimizer step.

        Call it after every optimizer step with the global number of positions consumed
        (``per-rank samples * world_size``). In stream mode (:meth:`set_global_batch_size`) it
        rolls into the next epoch. Otherwise it never does: counts that
        reach the end of the real samples finish the epoch (padding is not counted), and the
        loop starts the next one with :meth:`set_epoch`.

        Raises:
            ValueError: If the count is negative or exceeds what the current world still has
                to yield in this epoch.
        """
        if self._global_batch is not None:
            if num_global_samples < 0:
                raise ValueError(f"advance({num_global_samples}) must be non-negative.")
            consumed = self._consumed + num_global_samples
            length = self._epoch_length()
            while consumed >= length:
                consumed -= length
                self._epoch += 1
            self._consumed = consumed
            return
        available = len(self) * self._world_size
        if num_global_samples < 0 or num_global_samples > available:
            raise ValueError(
                f"advance({num_global_samples}) is outside [0, {available}], the positions "
                f"world size {self._world_size} still has in epoch {self._epoch}; call "
                "set_epoch() to start the next epoch."
            )
        self._consumed = min(self._dataset_size, self._consumed + num_global_samples)

    def reshard(self, rank: int, world_size: int) -> None:
        """Splits the rest of the epoch over a new world; the cursor is unchanged.

        Raises:
            ConfigError: If the world is larger than the dataset or ``rank`` is out of range.
        """
        if world_size < 1 or world_size > self._dataset_size:
            raise ConfigError(
                f"world size ({world_size}) must be between 1 and the dataset size "
                f"({self._dataset_size}); use fewer ranks or a larger dataset."
            )
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"rank ({rank}) must be in [0, {world_size}) for world size ({world_size})."
            )
        self._rank = rank
        self._world_size = world_size

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """Switches to an endless stream of fixed global batches (what :class:`ElasticLoop` uses).

        The stream is the epoch orders one after another, starting at the cursor (always a
        step boundary); step ``s`` is the stream's positions ``[s * G, (s + 1) * G)``, and
        rank ``r`` of ``W`` yields the step's positions ``j`` with ``j % W == r`` (so shares
        differ by at most one, on any world size: :mod:`elastic.batching`). :meth:`advance`
        rolls the cursor into the next epoch. Every optimizer step therefore trains exactly
        ``global_batch_size`` samples, with no padding, and each sample of each epoch exactly
        once. ``drop_last`` rule in this mode: when false, a step may straddle two epochs (the
        tail of one and the head of the next); when true, the last
        ``dataset_size % global_batch_size`` positions of every epoch's order are never
        trained, so that no step straddles epochs.

        Raises:
            ConfigError: If the batch is not positive, or is larger than the dataset with
                ``drop_last``.
        """
        if global_batch_size < 1:
            raise ConfigError(f"global_batch_size ({global_batch_size}) must be positive.")
        if self._drop_last and global_batch_size > self._dataset_size:
            raise ConfigError(
                f"global batch size ({global_batch_size}) is larger than the dataset "
                f"({self._dataset_size}) with drop_last=True, so no step could be trained; "
                "use a smaller global batch or drop_last=False."
            )
        self._global_batch = global_batch_size

    @property
    def global_batch_size(self) -> int | None:
        """The fixed global batch of stream mode, or ``None`` in per-epoch mode."""
        return self._global_batch

    def _epoch_length(self) -> int:
        """Positions of each epoch's order the stream uses."""
        if self._global_batch is not None and self._drop_last:
            return self._dataset_size - self._dataset_size % self._global_batch
        return self._dataset_size

    # -- positions: which places of which epoch orders this rank takes ---------------------

    def _step_blocks(self) -> tuple[int, Iterator[PositionBatch]]:
        """Stream mode: this rank's share per step, and its ``(epochs, positions)`` in blocks of
        whole steps, from the cursor.

        Step ``s`` is the stream offsets ``[s * G, (s + 1) * G)`` from the cursor (a step
        boundary); this rank takes the offsets ``j`` with ``j % W == rank``. Offset ``o`` is
        position ``(consumed + o) % L`` of epoch ``epoch + (consumed + o) // L`` (``L`` the
        epoch length). Blocks of several steps (:meth:`_steps_per_block`) evaluate the order in
        few numpy calls. Snapshots the cursor and the world.
        """
        assert self._global_batch is not None
        step, world, rank = self._global_batch, self._world_size, self._rank
        epoch, consumed, length = self._epoch, self._consumed, self._epoch_length()
        share = step // world + (1 if rank < step % world else 0)
        per_block = self._steps_per_block(share)
        offsets = (consumed + rank + world * np.arange(share, dtype=np.int64)
                   + step * np.arange(per_block, dtype=np.int64)[:, None]).ravel()

        def blocks() -> Iterator[PositionBatch]:
            base = 0
            while True:
                absolute = offsets + base
                yield epoch + absolute // length, absolute % length
                base += step * per_block

        return share, blocks()

    def _epoch_positions(self) -> Iterator[PositionBatch]:
        """Per-epoch mode: this rank's ``(epochs, positions)`` in chunks (see the class's
        ``drop_last`` rule). Snapshots the cursor and the world when called."""
        epoch, consumed, world, rank = self._epoch, self._consumed, self._world_size, self._rank
        real, count = self.remaining, len(self)

        def chunks() -> Iterator[PositionBatch]:
            for start in range(0, count, _CHUNK):
                j = rank + world * np.arange(start, min(count, start + _CHUNK), dtype=np.int64)
                if real > 0:  # padding repeats the rest of the epoch from its start
                    j = np.where(j < real, j, (j - real) % real)
                yield np.full(j.shape, epoch, dtype=np.int64), consumed + j

        return chunks()

    def positions(self) -> Iterator[PositionBatch]:
        """``(epochs, positions)`` of what :meth:`__iter__` yields, in chunks, in its order: for
        datasets that map positions to samples themselves
        (:class:`~elastic.stream.ElasticShardedStream`). Snapshots the cursor and the world."""
        if self._global_batch is not None:
            return self._step_blocks()[1]
        return self._epoch_positions()

    def position_batches(self, plan: BatchPlan) -> Iterator[PositionBatch]:
        """``(epochs, positions)`` of this rank's micro-batches, step after step (stream mode):
        what :meth:`micro_batches` maps to indices, for datasets that map positions to samples
        themselves (:class:`~elastic.stream.ElasticShardedStream`).

        Checks the plan and snapshots the cursor and the world when called.

        Raises:
            ConfigError: Outside stream mode, or if ``plan`` is for another world.
        """
        self._check_plan(plan)
        share, blocks = self._step_blocks()
        bounds = self._block_bounds(plan, share)

        def batches() -> Iterator[PositionBatch]:
            for epochs, positions in blocks:
                for lo, hi in itertools.pairwise(bounds):
                    yield epochs[lo:hi], positions[lo:hi]

        return batches()

    def _steps_per_block(self, share: int) -> int:
        """Steps per block: about ``_CHUNK`` positions, and no more steps than an epoch holds
        (a block then spans at most two epochs' orders)."""
        assert self._global_batch is not None
        return max(1, min(_CHUNK // share, self._epoch_length() // self._global_batch))

    def _check_plan(self, plan: BatchPlan) -> None:
        if self._global_batch is None or plan.global_batch_size != self._global_batch:
            raise ConfigError(
                f"micro_batches() needs stream mode with the plan's global batch "
                f"({plan.global_batch_size}); call set_global_batch_size() first."
            )
        if plan.world_size != self._world_size:
            raise ConfigError(
                f"the plan is for world size ({plan.world_size}) but the sampler is sharded "
                f"for ({self._world_size}); reshard() it first."
            )

    def _block_bounds(self, plan: BatchPlan, share: int) -> list[int]:
        """Where the micro-batches of a block of :meth:`_step_blocks` start and end."""
        sizes = plan.micro_batch_sizes(self._rank)
        per_block = self._steps_per_block(share)
        bounds: list[int] = np.cumsum([0, *sizes * per_block]).tolist()
        return bounds

    # -- indices ----------------------------------------------------------------------------

    def _indices(self, epochs: npt.NDArray[np.int64],
                 positions: npt.NDArray[np.int64]) -> list[int]:
        """The dataset indices at ``positions`` of the orders of ``epochs`` (non-decreasing)."""
        if epochs.size == 0:
            return []
        out: list[int] = []
        if epochs[0] == epochs[-1]:
            out.extend(self._order_of(int(epochs[0])).take(positions).tolist())
            return out
        cuts = np.flatnonzero(np.diff(epochs)) + 1
        for e, p in zip(np.split(epochs, cuts), np.split(positions, cuts), strict=True):
            out.extend(self._order_of(int(e[0])).take(p).tolist())
        return out

    def _stream(self) -> Iterator[int]:
        blocks = self._step_blocks()[1]

        def indices() -> Iterator[int]:
            for epochs, positions in blocks:
                yield from self._indices(epochs, positions)

        return indices()

    def micro_batches(self, plan: BatchPlan) -> Iterator[list[int]]:
        """This rank's micro-batches of indices, step after step (stream mode): a batch
        sampler for ``DataLoader(dataset, batch_sampler=...)``.

        Each step yields ``plan.micro_batch_sizes(rank)`` batches. It snapshots the cursor
        and the world when iteration starts: make a new one after a re-shard or a restore.

        Raises:
            ConfigError: Outside stream mode, or if ``plan`` is for another world.
        """
        self._check_plan(plan)
        share, blocks = self._step_blocks()
        bounds = self._block_bounds(plan, share)
        for epochs, positions in blocks:
            indices = self._indices(epochs, positions)
            for lo, hi in itertools.pairwise(bounds):
                yield indices[lo:hi]

    def stream_positions(self, count: int) -> list[tuple[int, int]]:
        """``(epoch, index)`` of the next ``count`` stream positions, over all ranks.

        Used by audits: the samples the next ``count // global_batch_size`` steps train.
        """
        length = self._epoch_length()
        absolute = self._consumed + np.arange(count, dtype=np.int64)
        epochs = self._epoch + absolute // length
        return list(zip(epochs.tolist(), self._indices(epochs, absolute % length), strict=True))

    # -- iteration --------------------------------------------------------------------------

    def epoch_order(self) -> Permutation:
        """The order of the current epoch: a lazy sequence (``order[position]`` is the index
        there; iterating it yields every index once), never materialised."""
        return self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> Permutation:
        order = self._orders.get(epoch)
        if order is None:
            if self._shuffle:
                order = epoch_permutation(self._dataset_size, self._seed, epoch)
            else:
                order = IdentityPermutation(self._dataset_size)
            if len(self._orders) >= 2:  # a step may straddle two epochs; keep no more
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order

    def __iter__(self) -> Iterator[int]:
        chunks = self.positions()  # the snapshot, taken now

        def indices() -> Iterator[int]:
            for epochs, positions in chunks:
                yield from self._indices(epochs, positions)

        return indices()

    def __len__(self) -> int:
        """Indices this rank yields; in stream mode, those left in the current epoch."""
        real = self.remaining
        if self._global_batch is not None:
            real = max(0, self._epoch_length() - self._consumed)
            steps, rest = divmod(real, self._global_batch)
            base, extra = divmod(self._global_batch, self._world_size)
            share = base + (1 if self._rank < extra else 0)
            tail = -(-(rest - self._rank) // self._world_size) if rest > self._rank else 0
            return steps * share + tail
        if self._drop_last:
            return real // self._world_size
        return -(-real // self._world_size)

    def padding_count(self) -> int:
        """How many of the indices this rank will yield are padding (0 or 1, always the last).

        Always 0 with ``drop_last=True``.
        """
        length = len(self)
        if self._drop_last or length == 0:
            return 0
        last_position = (length - 1) * self._world_size + self._rank
        return 1 if last_position >= self.remaining else 0

    # -- checkpointing ----------------------------------------------------------------------

    @property
    def order_name(self) -> str:
        """The construction of the epoch orders (saved as ``order``): a change is refused on
        resume rather than silently reinterpreted."""
        return ORDER if self._shuffle else _SEQUENTIAL

    def _identity(self) -> dict[str, Any]:
        """What the cursor's positions mean: the saved values that must match on resume."""
        return {
            "seed": self._seed,
            "dataset_size": self._dataset_size,
            "shuffle": self._shuffle,
            "order": self.order_name,
        }

    def state_dict(self) -> dict[str, Any]:
        """The rank-agnostic cursor: ``epoch``, ``consumed``, and the order's identity
        ``seed``, ``dataset_size``, ``shuffle``, ``order``."""
        return {"epoch": self._epoch, "consumed": self._consumed, **self._identity()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the cursor saved by :meth:`state_dict` on any rank of any world.

        A state without ``order`` was written by elastic-run before the constant-memory
        order, whose shuffled epochs were ``torch.randperm``: it is refused, since its cursor
        would index a different order (without shuffling, the order is the same and it is
        accepted).

        Raises:
            ConfigError: If keys are missing, or the saved permutation (dataset size, seed,
                shuffle, order) differs from this sampler's, or the cursor is out of range.
        """
        mine = self._identity()
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if not missing:
            self._check_saved(state_dict, ("dataset_size", "seed", "shuffle"))
            saved_order = state_dict.get(
                "order", _LEGACY_ORDER if state_dict["shuffle"] else _SEQUENTIAL)
            if saved_order != mine["order"]:
                if saved_order == _LEGACY_ORDER:
                    why = (": the checkpoint was written before elastic-run drew its epoch "
                           "orders in constant memory, so its cursor counts positions of "
                           "another order; finish that run with the elastic-run version that "
                           "wrote it")
                else:
                    why = (", so its cursor counts positions of another order; resume it with "
                           "the kind of sampler (or stream) that wrote it")
                raise ConfigError(
                    f"checkpointed sampler order ({saved_order}) differs from this sampler's "
                    f"order ({mine['order']}){why} or start in a new checkpoint directory."
                )
            missing = [key for key in mine if key not in state_dict and key != "order"]
        if missing:
            raise ConfigError(
                f"sampler state is missing keys ({', '.join(missing)}); pass a dict saved by "
                f"{self._STATE_SOURCE}."
            )
        self._check_saved(state_dict, [key for key in mine if key != "order"])
        epoch = int(state_dict["epoch"])
        consumed = int(state_dict["consumed"])
        if epoch < 0 or not 0 <= consumed <= self._dataset_size:
            raise ConfigError(
                f"checkpointed sampler cursor (epoch {epoch}, consumed {consumed}) is out of "
                f"range for dataset size ({self._dataset_size}); the checkpoint is corrupt."
            )
        self._epoch = epoch
        self._consumed = consumed

    def _check_saved(self, state_dict: Mapping[str, Any], keys: Sequence[str]) -> None:
        """Refuses a saved identity value that differs from this sampler's."""
        mine = self._identity()
        for key in keys:
            saved = state_dict[key]
            if saved != mine[key]:
                raise ConfigError(
                    f"checkpointed sampler {key} ({saved}) differs from this sampler's {key} "
                    f"({mine[key]}); construct the sampler with the same dataset and {key} as "
                    "the run that wrote the checkpoint."
                )
