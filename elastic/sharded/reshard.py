"""The heal of a sharded world: agree on a step every shard is held at, and re-shard into the
new world from the ranks that hold it, without reading storage.

Called by the in-place controller on every rank of a new world once its groups are built
(:meth:`~elastic.loop.sharding.ShardedWay.heal_sharded`):

1. **Build** the new world's model on a new mesh (``parallelize`` on a copy of the skeleton,
   :class:`~elastic.sharded.model.ShardedTraining`) and its optimizer. The old world's model
   stays as it is until the end: a heal that fails half-way (a peer died) leaves every
   holding intact, and the next attempt starts over.
2. **Agree**: every rank all-gathers its holdings (:class:`~elastic.sharded.plan.Holding`):
   its live shard and step, its own snapshot, the copy of a peer's shard it keeps. Holdings
   of ranks that missed the last heal are ignored (their state may predate a roll back).
   The newest step at which the holdings cover every row of every sharded tensor wins
   (:func:`~elastic.sharded.plan.choose_step`): the live step when every shard survived
   (a replica, an HSDP peer, or the lost rank's copy when it is current), else the newest
   complete snapshot. With none, the state comes from storage (the controller restores it).
3. **Small state** (loop step, data cursor, RNG, optimizer step counts and hyper-parameters,
   scheduler, buffers, the user's other state) comes from a holder of that step; only the
   ranks that hold nothing at it receive it (a newcomer, a rank rolled back further).
4. **Move** the rows each rank's new shard needs (:func:`~elastic.sharded.plan.plan_pieces`,
   :func:`~elastic.sharded.transfer.move_pieces`) point to point over the world's gloo group.
5. **Install** the new model, optimizer and scheduler, and load the small state.

Lost work: none when every shard survived at the live step (HSDP, or every lost rank's copy
current); otherwise the steps since the snapshot, and the data cursor goes back with them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch
import torch.distributed as dist

from elastic.inplace.heal import GlooLink, HealResult, receive_state, send_state
from elastic.sharded.copies import ShardCopies, Snapshot, clone_tree
from elastic.sharded.model import Built, ShardedTraining
from elastic.sharded.plan import KINDS, Holding, Kind, choose_step, plan_pieces
from elastic.sharded.transfer import DEFAULT_CHUNK_BYTES, move_pieces

__all__ = ["ReshardOutcome", "ShardedLoopState", "gather_holdings", "reshard_heal"]

logger = logging.getLogger(__name__)

#: Holdings a rank reports: its live state, two own snapshots, two copies.
_SLOTS: Final = 5
_FIELDS: Final = 1 + 4 * _SLOTS  # heal epoch, then (kind, step, shards, index) per slot

Slot = tuple[Kind, int, int, int]  # kind, step, shards, index


class ShardedLoopState(Protocol):
    """What the heal reads and writes of the loop besides the model."""

    def loop_small(self) -> dict[str, Any]:
        """The loop's own and the user's replicated state (live)."""

    def load_loop_small(self, small: dict[str, Any]) -> None:
        """Loads what :meth:`loop_small` returned."""


@dataclass(frozen=True, slots=True)
class ReshardOutcome:
    """A finished sharded heal.

    Attributes:
        result: What the controller records (step ``-1``: restore from storage).
        built: The new world's model (installed).
    """

    result: HealResult
    built: Built


def _encode(heal_epoch: int, slots: list[Slot]) -> torch.Tensor:
    if len(slots) > _SLOTS:
        raise ValueError(f"a rank reports at most {_SLOTS} holdings ({len(slots)} given).")
    values = [heal_epoch]
    for kind, step, shards, index in slots:
        values.extend((KINDS.index(kind), step, shards, index))
    values.extend([0, -1, 1, 0] * (_SLOTS - len(slots)))
    return torch.tensor(values, dtype=torch.int64)


def gather_holdings(heal_epoch: int, slots: list[Slot], group: dist.ProcessGroup
                    ) -> tuple[list[Holding], list[int]]:
    """All-gathers every rank's holdings; keeps those of the ranks that took part in the
    newest heal.

    Args:
        heal_epoch: The world epoch of this rank's last completed heal (``0``: none).
        slots: What this rank holds: ``(kind, step, shards, index)`` each.
        group: The world's gloo group.

    Returns:
        The trusted holdings, and every rank's live step (``-1``: none).
    """
    world = dist.get_world_size(group)
    gathered = [torch.zeros(_FIELDS, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, _encode(heal_epoch, slots), group=group)
    rows = []
    for tensor in gathered:
        row = tensor.tolist()
        rows.append((row[0], [(KINDS[row[1 + 4 * i]], *row[2 + 4 * i:5 + 4 * i])
                              for i in range(_SLOTS) if row[2 + 4 * i] >= 0]))
    newest = max((epoch for epoch, held in rows if held), default=0)
    holdings: list[Holding] = []
    live_steps: list[int] = []
    for rank, (epoch, held) in enumerate(rows):
        live_steps.append(max((h[1] for h in held if h[0] == "live"), default=-1))
        if epoch != newest:
            continue
        holdings.extend(Holding(rank=rank, kind=kind, step=step, shards=shards, index=index)
                        for kind, step, shards, index in held)
    return holdings, live_steps


def reshard_heal(*, training: ShardedTraining, copies: ShardCopies | None,
                 loop: ShardedLoopState, live_step: int, heal_epoch: int,
                 group: dist.ProcessGroup, device: torch.device, world_size: int,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ReshardOutcome:
    """The heal described in the module docstring, on every rank of the new world.

    Args:
        training: The model's builder and the old world's model (``current``).
        copies: This rank's snapshots (``None``: redundancy off).
        loop: The loop's replicated state.
        live_step: This rank's completed steps (``-1``: its live state is not usable).
        heal_epoch: See :func:`gather_holdings`.
        group: The new world's gloo group.
        device: This rank's device.
        world_size: The new world's size.
        chunk_bytes: Largest message.

    Raises:
        RuntimeError: If a peer fails meanwhile (every holding is left as it was).
    """
    started = time.monotonic()
    rank = dist.get_rank(group)
    old = training.current
    new = training.build(device, world_size)
    own, kept = copies.holdings() if copies is not None else ([], [])
    live = old if old is not None and live_step >= 0 else None
    snapshots: dict[tuple[Kind, int], Snapshot] = {
        **{("own", s.step): s for s in own}, **{("copy", s.step): s for s in kept}}
    slots: list[Slot] = [(kind, snap.step, snap.shards, snap.index)
                         for (kind, _), snap in snapshots.items()]
    if live is not None:
        slots.insert(0, ("live", live_step, live.shards, live.index))
    holdings, live_steps = gather_holdings(heal_epoch, slots, group)
    params = new.sharded_params()
    step = choose_step(holdings, [e.rows for e in params])
    if step < 0:
        training.install(new)
        logger.info("no step is held by every shard's holders (holdings %s): the state "
                    "comes from storage", holdings)
        return ReshardOutcome(HealResult(step=-1, source=-1, steps=tuple(live_steps),
                                         received=False), new)
    at = [h for h in holdings if h.step == step]
    source = min(at, key=lambda h: (KINDS.index(h.kind), h.rank))
    mine = min((h for h in at if h.rank == rank), key=lambda h: KINDS.index(h.kind),
               default=None)
    small = _small_of(mine, live, snapshots, loop, training)
    if small is not None and mine is not None and mine.kind != "live":
        small = clone_tree(small)  # loaded into live objects: the snapshot must stay as it is
    receivers = sorted({r for r in range(world_size)} - {h.rank for h in at})
    received = sent = 0
    link = GlooLink(group)
    if receivers and rank == source.rank:
        assert small is not None
        sent, _ = send_state(link, receivers, {"small": small}, chunk_bytes=chunk_bytes)
    elif rank in receivers:
        target: dict[str, Any] = {"small": {}}
        received, _ = receive_state(link, source.rank, target, device=device,
                                    chunk_bytes=chunk_bytes, mark_torn=False)
        small = target["small"]
    assert small is not None
    new.add_optimizer_entries(small["model"]["optim_keys"])
    entries = new.entries()
    pieces = plan_pieces(at, step, [e.rows for e in entries], [e.row_bytes for e in entries],
                         new.shards, new.shard_index)

    def read(tensor: int, kind: Kind) -> torch.Tensor:
        name = entries[tensor].name
        if kind == "live":
            assert live is not None
            return live.local(name)
        return snapshots[(kind, step)].tensors[name]

    moved = move_pieces(pieces, rank=rank, dims=[e.dim for e in entries],
                        row_bytes=[e.row_bytes for e in entries], read=read,
                        write=lambda tensor: new.local(entries[tensor].name), group=group,
                        chunk_bytes=chunk_bytes)
    ShardedTraining.load_small_state(new, small["model"])
    if mine is None or mine.kind != "live":
        loop.load_loop_small(small)  # a live holder's loop state is the agreed one already
    training.install(new)
    if copies is not None:
        copies.discard_after(step)
    best = max((h.step for h in holdings if h.kind == "live"), default=step)
    rolled = any(p.kind != "live" for p in pieces) or source.kind != "live"
    result = HealResult(
        step=step, source=source.rank, steps=tuple(live_steps),
        received=rank in receivers or any(p.dest == rank and p.source != rank for p in pieces),
        sent_bytes=sent + moved.sent_bytes, received_bytes=received + moved.received_bytes,
        staging_bytes=moved.staging_bytes, lost_steps=max(0, best - step),
        from_snapshots=rolled)
    logger.info("re-sharded into %d shards at step %d (%s; %d step(s) lost) in %.3fs: sent %d, "
                "received %d bytes", new.shards, step,
                "from snapshots" if rolled else "from live shards", result.lost_steps,
                time.monotonic() - started, result.sent_bytes, result.received_bytes)
    return ReshardOutcome(result, new)


def _small_of(mine: Holding | None, live: Built | None,
              snapshots: dict[tuple[Kind, int], Snapshot], loop: ShardedLoopState,
              training: ShardedTraining) -> dict[str, Any] | None:
    """This rank's replicated state at the agreed step, if it holds that step."""
    if mine is None:
        return None
    if mine.kind == "live":
        assert live is not None
        return {**loop.loop_small(), "model": training.small_state(live)}
    return snapshots[(mine.kind, mine.step)].small
