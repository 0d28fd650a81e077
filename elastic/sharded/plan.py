"""Who sends which rows of which tensor when sharded state moves to a new world (pure).

A sharded tensor of ``n`` rows along its shard dimension, cut into ``S`` shards, gives shard
``i`` the rows ``[i * c, (i + 1) * c)`` clipped to ``n``, with ``c = ceil(n / S)``: the cut of
``torch.chunk`` that ``DTensor``'s ``Shard`` placement and FSDP2 use (16 rows over 3 ranks are
6, 6 and 4; a single row over 3 ranks is 1, 0 and 0). Shard ``i`` of ``S`` is therefore the
same rows whatever world it was cut in, and everything here speaks of shards, not ranks.

A *holding* is one rank's copy of one shard of the whole state (every sharded tensor: the
parameters and their optimizer moments) at one step: its live state, the snapshot of its own
shard it took for redundancy, or the copy of a peer's shard it keeps
(:mod:`~elastic.sharded.copies`). When the world changes every rank of the new world states
its holdings; :func:`choose_step` picks the newest step at which the holdings cover every row
of every tensor, and :func:`plan_pieces` says, for each rank of the new world and each
tensor, which holder sends which rows of its shard. Both are deterministic, so every rank
computes the same plan from the same all-gathered holdings, and they are tested with tables
(``tests/unit/elastic/test_sharded_plan.py``).

The plan prefers rows a rank already holds (no transfer), then live state over snapshots,
then spreads the rest over the holders by the bytes each is already asked to send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["KINDS", "Holding", "Piece", "choose_step", "copy_holders", "hsdp_replicas",
           "plan_pieces", "shard_range"]

Kind = Literal["live", "own", "copy"]
KINDS: Final[tuple[Kind, ...]] = ("live", "own", "copy")


@dataclass(frozen=True, slots=True)
class Holding:
    """A rank's copy of shard ``index`` of ``shards`` of the state after ``step`` steps.

    Attributes:
        rank: The holder's rank in the new world.
        kind: ``"live"`` (its training state), ``"own"`` (the snapshot of its own shard) or
            ``"copy"`` (the snapshot of a peer's shard it keeps).
        step: Completed steps of the state it holds.
        shards: Number of shards of the world the shard was cut in.
        index: Which of them.
    """

    rank: int
    kind: Kind
    step: int
    shards: int
    index: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"holding kind ({self.kind!r}) is not one of {KINDS}.")
        if not (self.shards >= 1 and 0 <= self.index < self.shards):
            raise ValueError(f"shard index ({self.index}) must be in [0, {self.shards}).")


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` of tensor ``tensor`` go from ``source`` to ``dest``.

    Attributes:
        tensor: Index of the tensor in the catalog both sides share.
        source: Sending rank (equal to ``dest``: a local copy).
        kind: Which of the source's holdings the rows come from.
        dest: Receiving rank.
        start: First global row.
        stop: One past the last global row.
        source_offset: Row of ``start`` in the source's shard.
        dest_offset: Row of ``start`` in the receiver's new shard.
    """

    tensor: int
    source: int
    kind: Kind
    dest: int
    start: int
    stop: int
    source_offset: int
    dest_offset: int

    @property
    def rows(self) -> int:
        """Number of rows moved."""
        return self.stop - self.start


def shard_range(rows: int, shards: int, index: int) -> tuple[int, int]:
    """The global rows ``[start, stop)`` of shard ``index`` of ``shards`` (``torch.chunk``'s
    cut; the range may be empty)."""
    chunk = -(-rows // shards) if rows else 0
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def _covers(holdings: Sequence[Holding], rows: int) -> bool:
    spans = sorted(shard_range(rows, h.shards, h.index) for h in holdings)
    reached = 0
    for start, stop in spans:
        if start > reached:
            return False
        reached = max(reached, stop)
    return reached >= rows


def choose_step(holdings: Sequence[Holding], sizes: Sequence[int]) -> int:
    """The newest step at which ``holdings`` cover every row of tensors of ``sizes`` rows.

    Args:
        holdings: Every rank's holdings (already filtered: only trustworthy state).
        sizes: The row count (along the shard dimension) of each sharded tensor.

    Returns:
        The step, or ``-1`` if no step is covered (the state must come from storage).
    """
    distinct = sorted(set(sizes))
    for step in sorted({h.step for h in holdings if h.step >= 0}, reverse=True):
        at = [h for h in holdings if h.step == step]
        if all(_covers(at, rows) for rows in distinct):
            return step
    return -1


def plan_pieces(holdings: Sequence[Holding], step: int, sizes: Sequence[int],
                row_bytes: Sequence[int], shards: int, dest_index: Sequence[int]
                ) -> list[Piece]:
    """Every row each rank of the new world needs, and who sends it.

    Args:
        holdings: Every rank's holdings; only those at ``step`` are used.
        step: What :func:`choose_step` returned (at least 0).
        sizes: Row count of each sharded tensor (its index is :attr:`Piece.tensor`).
        row_bytes: Bytes of one row of each tensor (to spread the sending).
        shards: Number of shards of the new world.
        dest_index: The shard index of each new rank (its position is the rank).

    Returns:
        The pieces, ordered by tensor, receiver and row.

    Raises:
        ValueError: If the holdings at ``step`` leave a row uncovered.
    """
    if len(sizes) != len(row_bytes):
        raise ValueError(f"sizes ({len(sizes)}) and row_bytes ({len(row_bytes)}) differ.")
    at = sorted((h for h in holdings if h.step == step),
                key=lambda h: (h.rank, KINDS.index(h.kind)))
    sent: dict[int, int] = {}
    pieces: list[Piece] = []
    for tensor, (rows, width) in enumerate(zip(sizes, row_bytes, strict=True)):
        spans = [(h, *shard_range(rows, h.shards, h.index)) for h in at]
        for dest, index in enumerate(dest_index):
            start, stop = shard_range(rows, shards, index)
            position = start
            while position < stop:
                candidates = [(h, lo, hi) for h, lo, hi in spans if lo <= position < hi]
                if not candidates:
                    raise ValueError(f"row {position} of tensor {tensor} is held by no rank "
                                     f"at step {step}.")
                holder, lo, hi = min(candidates, key=lambda c: (
                    c[0].rank != dest, KINDS.index(c[0].kind), sent.get(c[0].rank, 0),
                    -c[2], c[0].rank))
                end = min(hi, stop)
                pieces.append(Piece(tensor=tensor, source=holder.rank, kind=holder.kind,
                                    dest=dest, start=position, stop=end,
                                    source_offset=position - lo,
                                    dest_offset=position - start))
                if holder.rank != dest:
                    sent[holder.rank] = sent.get(holder.rank, 0) + (end - position) * width
                position = end
    return pieces


def hsdp_replicas(world_size: int, replicate: int) -> int:
    """Replica groups of a world: the largest divisor of ``world_size`` not above
    ``replicate`` (a world of 5 with ``replicate=2`` is 1 group of 5: plain FSDP)."""
    if world_size < 1 or replicate < 1:
        raise ValueError(f"world size ({world_size}) and replicate ({replicate}) must be "
                         "positive.")
    return max(r for r in range(1, min(replicate, world_size) + 1) if world_size % r == 0)


def copy_holders(nodes: Sequence[str]) -> list[int]:
    """Which rank keeps the copy of each rank's shard, on another node where it can.

    ``nodes[r]`` is rank ``r``'s node (ranks of one node are consecutive, as in a world
    record). Rank ``r``'s copy goes to rank ``(r + k) % W`` for one offset ``k`` (so every
    rank keeps exactly one copy): the smallest ``k`` that puts every copy on another node, else
    the one that puts the most there, so that one node's loss loses as few copies as it can.
    A world of one rank has nobody to hold a copy: ``[-1]``.
    """
    world = len(nodes)
    if world < 2:
        return [-1] * world
    best_offset, best_crossing = 1, -1
    for offset in range(1, world):
        crossing = sum(nodes[r] != nodes[(r + offset) % world] for r in range(world))
        if crossing > best_crossing:
            best_offset, best_crossing = offset, crossing
        if crossing == world:
            break
    return [(r + best_offset) % world for r in range(world)]
