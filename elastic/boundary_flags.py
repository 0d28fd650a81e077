"""Agreeing on per-step flags across ranks without a device synchronisation per step.

Every rank must act on a drain request or a membership change at the same step boundary, so
the flags are all-reduced (MAX) at every step. Reading the result at once (``.tolist()``)
makes the host wait for the device to finish the whole step: with CUDA the CPU can no longer
queue the next step while the GPU runs this one. :class:`BoundaryFlags` reads one step late
instead: at the end of step ``s`` it starts the all-reduce of step ``s``'s flags and returns
the agreed flags of step ``s - 1``, whose all-reduce finished long ago (on CUDA, the result
is copied into pinned host memory behind the all-reduce on the stream, and only that copy's
event is waited for). Every rank calls it at the same steps, so every rank gets the same
answer at the same step: the agreement stays exact, one step later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BoundaryFlags"]


@dataclass(slots=True)
class _Exchange:
    work: Any  # the all-reduce's Work (gloo: waited for when read)
    values: torch.Tensor  # host memory holding the agreed values once done
    event: Any  # CUDA: the copy's event; None on CPU


class BoundaryFlags:
    """One-step-late agreement (MAX over ranks) on a fixed number of boolean flags.

    Args:
        count: Flags per exchange.
        device: Where the training group's collectives run (its tensors' device).
        group: The training group (``None``: the default group).
    """

    def __init__(self, count: int, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> None:
        if count < 1:
            raise ValueError(f"count ({count}) must be at least 1.")
        self.count = count
        self.device = device
        self.group = group
        self._accelerated = device.type == "cuda"
        pinned = self._accelerated and torch.cuda.is_available()
        # Two of each, used in turn: one exchange in flight while the previous one is read.
        self._sent = [torch.zeros(count, pin_memory=pinned) for _ in range(2)]
        self._reduced = [torch.zeros(count, device=device) for _ in range(2)]
        self._received = [torch.zeros(count, pin_memory=pinned) if self._accelerated
                          else self._reduced[i] for i in range(2)]
        self._turn = 0
        self._pending: _Exchange | None = None

    def exchange(self, flags: Sequence[bool]) -> tuple[bool, ...] | None:
        """Starts agreeing on ``flags`` and returns what the previous call agreed on.

        Returns:
            The previous exchange's flags, each ``True`` if any rank raised it; ``None`` on
            the first call after construction or :meth:`reset`. In a group of one rank the
            flags come back at once.

        Raises:
            RuntimeError: If the previous all-reduce failed (a peer died).
        """
        if len(flags) != self.count:
            raise ValueError(f"expected {self.count} flags, got {len(flags)}.")
        if dist.get_world_size(self.group) == 1:
            self._pending = None
            return tuple(bool(f) for f in flags)
        turn, self._turn = self._turn, 1 - self._turn
        sent, reduced, received = self._sent[turn], self._reduced[turn], self._received[turn]
        for i, flag in enumerate(flags):
            sent[i] = 1.0 if flag else 0.0
        reduced.copy_(sent, non_blocking=self._accelerated)
        work = dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        event = None
        if self._accelerated:
            assert work is not None
            work.wait()  # NCCL: makes the current stream wait for it; the host does not
            received.copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        previous, self._pending = self._pending, _Exchange(work, received, event)
        return None if previous is None else self._read(previous)

    def flush(self) -> tuple[bool, ...] | None:
        """Waits for the exchange in flight and returns its flags (``None``: none in flight)."""
        pending, self._pending = self._pending, None
        return None if pending is None else self._read(pending)

    def reset(self) -> None:
        """Forgets the exchange in flight without waiting for it (its group is being replaced
        after a failure); the next :meth:`exchange` returns ``None``."""
        self._pending = None

    @staticmethod
    def _read(exchange: _Exchange) -> tuple[bool, ...]:
        if exchange.event is not None:
            exchange.event.synchronize()
        elif exchange.work is not None:
            exchange.work.wait()
        return tuple(bool(v > 0) for v in exchange.values.tolist())
