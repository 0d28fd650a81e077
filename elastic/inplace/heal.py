"""Agree on the step to continue from, and copy state from a survivor to whoever is behind.

Resolution of a partial step (a step some ranks completed and others did not): a rank's
step counter counts the optimizer steps it *completed* (``ElasticLoop.end_step`` increments
it after ``optimizer.step()``), and a rank can only complete step ``s`` once the gradient
all-reduce of ``s`` returned, i.e. with every rank's contribution. Any rank holding step
``s`` therefore holds the correct state after ``s``. The new world all-gathers every rank's
step (``-1``: no state, a newcomer); the maximum wins, the lowest rank holding it is the
source, and it sends its full state (model, optimizer, user state, loop step, RNG and sampler
cursor) to the ranks behind it, and only to them. Lost work is at most the step in flight.
Storage is read only when no rank holds state (a fresh job, or every worker died).

**Transfer.** Point-to-point sends from the source to each receiver on the (gloo) group the
agreement ran on: no new group (a subgroup of the source and the receivers would cost a
collective ``new_group`` on every rank, a rendezvous and a new full mesh of connections that
the world's :class:`~elastic.inplace.abort.WorldAbort` never noted), and ranks that are up to
date receive nothing. gloo's broadcast sends from the root to each rank one by one too, so
nothing is lost against it. The state goes as a JSON header (structure and small leaves, no
pickle: :mod:`~elastic.inplace.state_wire`) followed by the tensors' bytes in messages of at
most ``chunk_bytes``: small tensors are packed together, large ones split into messages of
their own.

**Memory.** A CPU tensor is sent straight from its own memory and received straight into
the receiving rank's tensor at the same place in its state (its parameters, its optimizer's
moments: a newcomer's optimizer has them once ``ModelOptimizerState.state_dict()`` has
initialised it) when shapes and dtypes match, so a CPU heal copies nothing on the host. Only
packed small tensors, and tensors on an accelerator (copied device to host on the source and
host to device on the receiver, chunk by chunk), pass through one reused host buffer of at
most ``chunk_bytes``. Tensors without a local counterpart are allocated where the receiver
keeps them: an accelerator tensor of the source lands on the receiver's own device
(``map_location`` semantics), a CPU tensor (RNG states, the optimizer's step counts) on CPU.

**Accelerators.** The gloo path serves CUDA state too, at the host link's speed. A transfer
over the NCCL group (GPU to GPU) would be faster for large models, but NCCL point-to-point
communicators are created lazily per pair (a collective init inside a heal, on the world a
watch thread may be aborting), and that path cannot be exercised here; the transport is one
small class (:class:`GlooLink`) so that it can be swapped once it is measured on GPUs.

**Torn state.** Receiving in place overwrites the receiver's live tensors. If the source
dies half-way, this rank's state is a mixture of two steps, so until a later heal completes
(or the world restores from storage) it reports ``-1`` (no state) in the agreement and can
never become a source.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch
import torch.distributed as dist

from elastic.inplace.state_wire import (
    Path,
    TensorSpec,
    decode_header,
    encode_error,
    encode_header,
    flatten,
    tensor_paths,
    unflatten,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "GlooLink", "HealResult", "Link", "agree_and_heal",
           "load_state", "receive_state", "send_state", "target_device"]

logger = logging.getLogger(__name__)

#: Largest message of a heal, and so the largest host buffer it uses.
DEFAULT_CHUNK_BYTES: Final = 32 << 20

# Set while this process's live tensors are being overwritten by a heal; cleared when the heal
# completes. A process whose heal failed half-way holds no usable state.
_TORN = threading.Event()


@dataclass(frozen=True, slots=True)
class HealResult:
    """What the agreement decided, and what this rank moved.

    Attributes:
        step: The step every rank continues from (``-1``: no rank holds state).
        source: Rank that sent its state (``-1``: nothing was sent).
        steps: Each rank's step before the heal.
        received: Whether this rank loaded the source's state.
        sent_bytes: Bytes this rank sent (header and tensors, summed over receivers).
        received_bytes: Bytes this rank received.
        staging_bytes: Size of the host buffer this rank used (``0``: none).
        lost_steps: Completed steps the world went back over (sharded state rolled back to
            a snapshot, :mod:`elastic.sharded`).
        from_snapshots: Whether some state came from snapshots rather than live state.
    """

    step: int
    source: int
    steps: tuple[int, ...]
    received: bool
    sent_bytes: int = 0
    received_bytes: int = 0
    staging_bytes: int = 0
    lost_steps: int = 0
    from_snapshots: bool = False


class Link(Protocol):
    """Point-to-point byte transport between the ranks of one group."""

    def send(self, buf: torch.Tensor, peers: Sequence[int]) -> None:
        """Sends the CPU ``uint8`` tensor ``buf`` to each of ``peers`` (group ranks)."""

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        """Fills the CPU ``uint8`` tensor ``buf`` with the next message from ``peer``."""


class GlooLink:
    """:class:`Link` over a gloo process group.

    Args:
        group: The group (its ranks are the peers' numbers).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, buf: torch.Tensor, peers: Sequence[int]) -> None:
        """See :class:`Link`; the sends to several peers run concurrently."""
        works = [dist.isend(buf, group=self.group, group_dst=peer) for peer in peers]
        for work in works:
            if work is not None:
                work.wait()

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        """See :class:`Link`."""
        dist.recv(buf, group=self.group, group_src=peer)


@dataclass(frozen=True, slots=True)
class _Piece:
    tensor: int
    start: int
    end: int


def _messages(specs: Sequence[TensorSpec], chunk_bytes: int) -> list[list[_Piece]]:
    """Byte ranges of the tensors, in messages of at most ``chunk_bytes``.

    A tensor of ``chunk_bytes`` or more has messages of its own (one per chunk), so that a CPU
    tensor goes straight from and into tensor memory; smaller ones are packed together.
    """
    messages: list[list[_Piece]] = []
    current: list[_Piece] = []
    used = 0
    for index, spec in enumerate(specs):
        size = spec.nbytes
        if size == 0:
            continue
        if size >= chunk_bytes or used + size > chunk_bytes:
            if current:
                messages.append(current)
            current, used = [], 0
        if size >= chunk_bytes:
            messages.extend([_Piece(index, pos, min(pos + chunk_bytes, size))]
                            for pos in range(0, size, chunk_bytes))
            continue
        current.append(_Piece(index, 0, size))
        used += size
    if current:
        messages.append(current)
    return messages


def _size(message: list[_Piece]) -> int:
    return sum(p.end - p.start for p in message)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's data (same memory)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Staging:
    """The one host buffer of a heal side, allocated at the largest size it needs."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self._pinned = pinned and torch.cuda.is_available()
        self._buf: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self._buf is None:
            self._buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        return self._buf[:nbytes]

    @property
    def used(self) -> int:
        return 0 if self._buf is None else self.nbytes


def _plain(state: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k): (v.state_dict() if hasattr(v, "state_dict") else v)
            for k, v in state.items()}


def _send_header(link: Link, peers: Sequence[int], header: bytes) -> int:
    link.send(torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8), peers)
    link.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), peers)
    return (8 + len(header)) * len(peers)


def send_state(link: Link, receivers: Sequence[int], state: Mapping[str, Any], *,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[int, int]:
    """The source's side of a heal: sends ``state`` to each of ``receivers``.

    Returns:
        Bytes sent (summed over receivers) and the size of the host buffer used.

    Raises:
        TypeError: If ``state`` holds a value the wire format cannot carry (the receivers
            are told, and raise too).
    """
    try:
        skeleton, tensors, _ = flatten(_plain(state))
        header = encode_header(skeleton, tensors)
    except TypeError as exc:
        _send_header(link, receivers, encode_error(str(exc)))
        raise
    sent = _send_header(link, receivers, header)
    specs = [TensorSpec(t.dtype, tuple(t.shape), t.device.type) for t in tensors]
    messages = _messages(specs, chunk_bytes)

    def direct(message: list[_Piece]) -> bool:
        t = tensors[message[0].tensor]
        return len(message) == 1 and t.device.type == "cpu" and t.is_contiguous()

    staging = _Staging(max((_size(m) for m in messages if not direct(m)), default=0),
                       pinned=any(t.device.type != "cpu" for t in tensors))
    current: tuple[int, torch.Tensor] | None = None  # a tensor's contiguous bytes, while sent
    for message in messages:
        size = _size(message)
        if direct(message):
            piece = message[0]
            buf = _bytes_of(tensors[piece.tensor])[piece.start:piece.end]
        else:
            buf = staging.take(size)
            offset = 0
            for piece in message:
                if current is None or current[0] != piece.tensor:
                    current = (piece.tensor, _bytes_of(tensors[piece.tensor].contiguous()))
                length = piece.end - piece.start
                buf[offset:offset + length].copy_(current[1][piece.start:piece.end])
                offset += length
        link.send(buf, receivers)
        sent += size * len(receivers)
    return sent, staging.used


def target_device(spec: TensorSpec, local: torch.Tensor | None,
                  device: torch.device) -> tuple[torch.device, bool]:
    """Where a received tensor goes on the receiving rank.

    Args:
        spec: The tensor as the source described it.
        local: The receiver's own tensor at the same place in its state, if any.
        device: The receiver's device.

    Returns:
        The device, and whether the bytes go straight into ``local`` (same shape and dtype).
        A tensor with a local counterpart stays on the counterpart's device; otherwise an
        accelerator tensor of the source goes to ``device`` and a CPU tensor stays on CPU.
    """
    if local is not None:
        in_place = (type(local) is torch.Tensor or isinstance(local, torch.nn.Parameter)) \
            and tuple(local.shape) == spec.shape and local.dtype == spec.dtype
        return local.device, in_place
    if spec.device_type == "cpu":
        return torch.device("cpu"), False
    return device, False


def _receiver_device(local: Sequence[torch.Tensor]) -> torch.device:
    for tensor in local:
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device
    return torch.device("cpu")


def _recv_header(link: Link, source: int) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    link.recv(size.view(torch.uint8), source)
    length = int(size.item())
    if not 0 < length < 1 << 31:
        raise ValueError(f"heal header of an invalid length ({length}) from rank {source}.")
    payload = torch.empty(length, dtype=torch.uint8)
    link.recv(payload, source)
    return payload.numpy().tobytes()


def receive_state(link: Link, source: int, state: Mapping[str, Any], *,
                  device: torch.device | None = None,
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                  mark_torn: bool = True) -> tuple[int, int]:
    """A receiver's side of a heal: receives the source's state and loads it into ``state``.

    Args:
        link: The transport.
        source: The source's rank in the link's group.
        state: This rank's state; ``Stateful`` values are loaded with ``load_state_dict``,
            tensors and dicts in place.
        device: This rank's device (``None``: the device of its first accelerator tensor,
            else CPU).
        chunk_bytes: Must equal the source's.
        mark_torn: Whether receiving into ``state``'s own tensors marks this process's state
            torn until it completes (see the module docstring); ``False`` for state that is
            not the training state (a peer's shard copy).

    Returns:
        Bytes received and the size of the host buffer used.
    """
    header_bytes = _recv_header(link, source)
    received = 8 + len(header_bytes)
    header = decode_header(header_bytes)
    try:
        _, local_tensors, local_paths = flatten(_plain(state))
    except TypeError:  # this rank's own state cannot be matched: receive into new tensors
        local_tensors, local_paths = [], []
    local: dict[Path, torch.Tensor] = dict(zip(local_paths, local_tensors, strict=True))
    if device is None:
        device = _receiver_device(local_tensors)
    targets: list[torch.Tensor] = []
    writable: list[torch.Tensor] = []  # contiguous memory each tensor's bytes go into
    for spec, path in zip(header.tensors, tensor_paths(header.tree), strict=True):
        mine = local.get(path)
        where, in_place = target_device(spec, mine, device)
        target = mine if in_place and mine is not None else torch.empty(
            spec.shape, dtype=spec.dtype, device=where)
        targets.append(target)
        writable.append(target if target.is_contiguous() else torch.empty(
            spec.shape, dtype=spec.dtype, device=target.device))
    views = [_bytes_of(w) for w in writable]
    messages = _messages(header.tensors, chunk_bytes)

    def direct(message: list[_Piece]) -> bool:
        return len(message) == 1 and views[message[0].tensor].device.type == "cpu"

    staging = _Staging(max((_size(m) for m in messages if not direct(m)), default=0),
                       pinned=any(v.device.type != "cpu" for v in views))
    if mark_torn and any(t is local.get(p) for t, p in
                         zip(targets, tensor_paths(header.tree), strict=True)):
        _TORN.set()
    with torch.no_grad():
        for message in messages:
            size = _size(message)
            if direct(message):
                piece = message[0]
                link.recv(views[piece.tensor][piece.start:piece.end], source)
            else:
                buf = staging.take(size)
                link.recv(buf, source)
                offset = 0
                for piece in message:
                    length = piece.end - piece.start
                    views[piece.tensor][piece.start:piece.end].copy_(buf[offset:offset + length])
                    offset += length
            received += size
        for target, written in zip(targets, writable, strict=True):
            if written is not target:
                target.copy_(written)
        load_state(state, unflatten(header.tree, targets))
    if mark_torn:
        _TORN.clear()
    return received, staging.used


def load_state(state: Mapping[str, Any], plain: Any) -> None:
    """Loads a plain state tree (what a heal received) into ``state``'s entries, in place:
    ``Stateful`` values with ``load_state_dict``, tensors by copy, dicts by replacement.

    Raises:
        ValueError: If the entries differ.
        TypeError: If an entry cannot be loaded in place.
    """
    if not isinstance(plain, dict) or set(plain) != {str(k) for k in state}:
        theirs = sorted(plain) if isinstance(plain, dict) else type(plain).__name__
        raise ValueError(
            f"the source's state has entries ({theirs}) but this rank's has "
            f"({sorted(str(k) for k in state)}); every rank must build the same state."
        )
    for key, target in state.items():
        value = plain[str(key)]
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        elif isinstance(target, torch.Tensor):
            if value is not target:
                target.copy_(value)
        elif isinstance(target, dict):
            target.clear()
            target.update(value)
        else:
            raise TypeError(
                f"state entry {key!r} ({type(target).__name__}) cannot be healed in place; "
                "wrap it in an object with state_dict()/load_state_dict()."
            )


def agree_and_heal(
    my_step: int, state: Mapping[str, Any], group: dist.ProcessGroup, *,
    device: torch.device | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> HealResult:
    """The collective agreement and transfer described in the module docstring.

    Every rank of ``group`` must call it with its completed step (``-1`` without state) and
    the same ``chunk_bytes``.

    Args:
        my_step: This rank's completed step, ``-1`` if it holds no state.
        state: This rank's state (what ``ElasticLoop.heal_state()`` returns).
        group: A gloo group of the world (the checkpoint group).
        device: This rank's device (``None``: the device of its first accelerator tensor).
        chunk_bytes: Largest message, and so the largest host buffer a rank uses.
    """
    if _TORN.is_set() and my_step >= 0:
        logger.warning("an earlier heal into this rank's state failed half-way; it reports no "
                       "state (step %d discarded)", my_step)
        my_step = -1
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([my_step], dtype=torch.int64), group=group)
    steps = tuple(int(t.item()) for t in gathered)
    best = max(steps)
    if best < 0:
        _TORN.clear()  # every rank restores from storage, this one included
    if best < 0 or min(steps) == best:
        return HealResult(step=best, source=-1, steps=steps, received=False)
    source = steps.index(best)
    receivers = [r for r, s in enumerate(steps) if s < best]
    link = GlooLink(group)
    sent = got = staging = 0
    if rank == source:
        sent, staging = send_state(link, receivers, state, chunk_bytes=chunk_bytes)
    elif rank in receivers:
        got, staging = receive_state(link, source, state, device=device,
                                     chunk_bytes=chunk_bytes)
    logger.info("healed at step %d from rank %d to ranks %s (steps %s; sent %d, received %d "
                "bytes)", best, source, receivers, steps, sent, got)
    return HealResult(step=best, source=source, steps=steps, received=rank in receivers,
                      sent_bytes=sent, received_bytes=got, staging_bytes=staging)
