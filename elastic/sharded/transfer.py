"""Moving the rows of a re-shard plan between ranks, point to point over a gloo group.

Every rank computes the same plan (:func:`~elastic.sharded.plan.plan_pieces`), so each knows
what it sends to whom and what it receives from whom, and in which order: the pieces in
``(source, dest, tensor, row)`` order, each split into messages of at most ``chunk_bytes``.
All sends and receives of a rank are posted at once (gloo's ``isend``/``irecv``) and then
waited for: no rank waits for another to finish sending first, and a pair's messages match
because both sides post them in the same order.

Rows along dimension 0 of a contiguous CPU tensor are contiguous memory: they are sent
straight from the source's shard and received straight into the receiver's new shard, with
no copy. Anything else (another dimension, an accelerator tensor) passes through a host
buffer of the message's size: gloo's point-to-point calls take CPU tensors, so a CUDA shard
is copied to the host on the source and back to the device on the receiver. Rows a rank
already holds are copied locally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from elastic.sharded.plan import Kind, Piece

__all__ = ["DEFAULT_CHUNK_BYTES", "Moved", "move_pieces"]

#: Largest message of a re-shard.
DEFAULT_CHUNK_BYTES: Final = 32 << 20

Reader = Callable[[int, Kind], torch.Tensor]
Writer = Callable[[int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Moved:
    """What one rank moved in a re-shard.

    Attributes:
        sent_bytes: Bytes it sent.
        received_bytes: Bytes it received.
        local_bytes: Bytes it copied from its own holdings.
        staging_bytes: Bytes of host buffers it used (``0``: everything went direct).
    """

    sent_bytes: int
    received_bytes: int
    local_bytes: int
    staging_bytes: int


def _rows(tensor: torch.Tensor, dim: int, offset: int, count: int) -> torch.Tensor:
    return tensor.narrow(dim, offset, count)


def _direct(view: torch.Tensor) -> bool:
    return view.device.type == "cpu" and view.is_contiguous()


def _bytes(view: torch.Tensor) -> torch.Tensor:
    return view.reshape(-1).view(torch.uint8)


def _messages(piece: Piece, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(row offset within the piece, rows)`` of each message of ``piece``."""
    per = max(1, chunk_bytes // max(1, row_bytes))
    return [(offset, min(per, piece.rows - offset)) for offset in range(0, piece.rows, per)]


def move_pieces(pieces: Sequence[Piece], *, rank: int, dims: Sequence[int],
                row_bytes: Sequence[int], read: Reader, write: Writer,
                group: dist.ProcessGroup, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Moved:
    """Executes this rank's part of a re-shard plan.

    Args:
        pieces: The plan (every rank passes the same one).
        rank: This rank in ``group``.
        dims: The sharded dimension of each tensor.
        row_bytes: Bytes of one row of each tensor.
        read: ``read(tensor, kind)``: this rank's shard of a tensor in one of its holdings.
        write: ``write(tensor)``: this rank's new shard of a tensor (written in place).
        group: A gloo group of the new world.
        chunk_bytes: Largest message.

    Raises:
        RuntimeError: If a peer fails meanwhile (gloo's error; the new shards are then
            incomplete, and the holdings untouched).
    """
    mine = sorted((p for p in pieces if rank in (p.source, p.dest)),
                  key=lambda p: (p.source, p.dest, p.tensor, p.start))
    sent = received = local = staging = 0
    works: list[Any] = []
    landings: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, destination)
    keep: list[torch.Tensor] = []  # send buffers must outlive their sends
    with torch.no_grad():
        for piece in mine:
            dim, width = dims[piece.tensor], row_bytes[piece.tensor]
            if piece.source == piece.dest:
                source = _rows(read(piece.tensor, piece.kind), dim, piece.source_offset,
                               piece.rows)
                _rows(write(piece.tensor), dim, piece.dest_offset, piece.rows).copy_(source)
                local += piece.rows * width
                continue
            for offset, count in _messages(piece, width, chunk_bytes):
                if piece.source == rank:
                    view = _rows(read(piece.tensor, piece.kind), dim,
                                 piece.source_offset + offset, count)
                    if not _direct(view):
                        view = view.to("cpu", copy=True).contiguous()
                        staging += count * width
                    keep.append(view)
                    works.append(dist.isend(_bytes(view), group=group, group_dst=piece.dest))
                    sent += count * width
                else:
                    target = _rows(write(piece.tensor), dim, piece.dest_offset + offset, count)
                    if _direct(target):
                        buffer = target
                    else:
                        buffer = torch.empty(target.shape, dtype=target.dtype)
                        landings.append((buffer, target))
                        staging += count * width
                    works.append(dist.irecv(_bytes(buffer), group=group,
                                            group_src=piece.source))
                    received += count * width
        for work in works:
            if work is not None:
                work.wait()
        for buffer, target in landings:
            target.copy_(buffer)
    return Moved(sent_bytes=sent, received_bytes=received, local_bytes=local,
                 staging_bytes=staging)
