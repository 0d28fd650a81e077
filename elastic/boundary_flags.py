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

Even asynchronous, an all-reduce costs the host a few hundred microseconds (gloo), as much as
a small step's whole budget. :class:`AgreementCadence` therefore spaces the exchanges to
about one every :data:`AGREEMENT_INTERVAL_S` (every step when steps are longer than that):
each exchange also carries the ranks' step time (MAX), and from the agreed value every rank
computes the same next agreement step. A drain or a newer world is then acted on within
about two intervals, at the same step on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

__all__ = ["AGREEMENT_INTERVAL_S", "AgreementCadence", "BoundaryFlags"]

AGREEMENT_INTERVAL_S: Final = 0.05
"""Seconds between two agreements when steps are shorter than that."""
MAX_STEPS_BETWEEN: Final = 64
"""At most this many steps between two agreements, however short the steps."""


@dataclass(slots=True)
class _Exchange:
    work: Any  # the all-reduce's Work (gloo: waited for when read)
    values: torch.Tensor  # host memory holding the agreed values once done
    event: Any  # CUDA: the copy's event; None on CPU


class BoundaryFlags:
    """One-step-late agreement (MAX over ranks) on a fixed number of boolean flags, and on
    one number (the ranks' step time, for :class:`AgreementCadence`).

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
        size = count + 1  # the flags, then the measure
        self._sent = [torch.zeros(size, pin_memory=pinned) for _ in range(2)]
        self._reduced = [torch.zeros(size, device=device) for _ in range(2)]
        self._received = [torch.zeros(size, pin_memory=pinned) if self._accelerated
                          else self._reduced[i] for i in range(2)]
        self._turn = 0
        self._pending: _Exchange | None = None
        #: The largest ``measure`` any rank sent with the exchange last read (0.0 before).
        self.agreed_measure = 0.0

    def exchange(self, flags: Sequence[bool], measure: float = 0.0
                 ) -> tuple[bool, ...] | None:
        """Starts agreeing on ``flags`` (and ``measure``, see :attr:`agreed_measure`) and
        returns what the previous call agreed on.

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
            self.agreed_measure = measure
            return tuple(bool(f) for f in flags)
        turn, self._turn = self._turn, 1 - self._turn
        sent, reduced, received = self._sent[turn], self._reduced[turn], self._received[turn]
        sent.copy_(torch.tensor([*(1.0 if f else 0.0 for f in flags), measure]))
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
        return None if previous is None else self._read_measured(previous)

    def flush(self) -> tuple[bool, ...] | None:
        """Waits for the exchange in flight and returns its flags (``None``: none in flight)."""
        pending, self._pending = self._pending, None
        return None if pending is None else self._read_measured(pending)

    def reset(self) -> None:
        """Forgets the exchange in flight without waiting for it (its group is being replaced
        after a failure); the next :meth:`exchange` returns ``None``."""
        self._pending = None

    def _read_measured(self, exchange: _Exchange) -> tuple[bool, ...]:
        if exchange.event is not None:
            exchange.event.synchronize()
        elif exchange.work is not None:
            exchange.work.wait()
        *flags, self.agreed_measure = exchange.values.tolist()
        return tuple(bool(v > 0) for v in flags)


class AgreementCadence:
    """At which steps the ranks agree (see the module docstring); the same on every rank.

    Call :meth:`due` at every step boundary; exchange only when it says so, then pass the
    agreed step time (:attr:`BoundaryFlags.agreed_measure`) of each exchange read to
    :meth:`agreed`. :meth:`reset` (a new world, an abandoned step) makes the next boundary
    an agreement step again, on every rank alike.

    Args:
        interval_s: The wanted time between two agreements.
        max_steps_between: The most steps between two agreements.
    """

    def __init__(self, interval_s: float = AGREEMENT_INTERVAL_S,
                 max_steps_between: int = MAX_STEPS_BETWEEN) -> None:
        self.interval_s = interval_s
        self.max_steps_between = max_steps_between
        self._next: int | None = None  # None: the next boundary
        self._since: tuple[int, float] | None = None  # (step, time) of the last agreement

    def reset(self) -> None:
        """Agree at the next step boundary (every rank resets at the same step)."""
        self._next = None
        self._since = None

    def due(self, step: int) -> bool:
        """Whether the boundary after ``step`` steps is an agreement step."""
        return self._next is None or step >= self._next

    def step_time(self, step: int) -> float:
        """This rank's mean step time since the last agreement step (0.0: unknown yet),
        and marks ``step`` as an agreement step."""
        now = time.perf_counter()
        since, self._since = self._since, (step, now)
        if since is None or step <= since[0]:
            return 0.0
        return (now - since[1]) / (step - since[0])

    def agreed(self, step: int, step_s: float) -> None:
        """Plans the next agreement from the agreed (slowest rank's) step time."""
        if step_s <= 0:
            self._next = step + 1
            return
        between = math.ceil(self.interval_s / step_s)
        self._next = step + max(1, min(self.max_steps_between, between))
