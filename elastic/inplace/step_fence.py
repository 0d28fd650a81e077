"""Keeping a step computed on an aborted NCCL collective from counting: the step fence.

Aborting an NCCL communicator (:mod:`~elastic.inplace.abort`) does not raise in the training
thread for work already queued: the collective's kernels are released and their output is
garbage. NCCL leaves no flag on the device, so nothing queued after the collective can tell.
Something must keep a survivor from applying such a step and then offering its state to
the others in a heal. What a world abort guarantees, and both modes below rest on: the
world's abort flag (:attr:`WorldAbort.aborted`) is set, and :meth:`StepFence.on_abort`
has run, *before* any communicator is aborted. So a stream that the host saw finish while
the flag was clear finished on real collectives. ``ELASTIC_NCCL_STEP_FENCE`` chooses how
the host sees it finish:

* ``1`` (the default), **a host wait before every optimizer step**: the host waits for the
  current stream (the step's gradient all-reduces are on it: DDP makes the stream wait for
  them at the end of backward), then checks the flag. A step of an aborted world raises
  and is abandoned before anything is applied; a survivor loses at most the step in
  flight. The cost: the host stops running ahead of the device once per step. While it
  waits for the backward, it cannot queue the optimizer step and the next forward, so
  the GPU idles for as long as the host takes to queue the next kernels (microseconds
  for a few large kernels, up to milliseconds for a launch-bound model with many small
  ones). A loop that already waits once per step (``loss.item()``, ``GradScaler``, clipping
  with ``error_if_nonfinite``) pays nothing more.
* ``0``, **checking later, without waiting**: before each optimizer step a CUDA event is
  recorded on the stream and the step is applied at once. Events found finished later
  (polled without waiting) clear their steps. When the world is aborted, :meth:`on_abort`
  first notes which recorded steps had not finished. A survivor that applied one of them
  holds garbage: it reports no state in the heal and is healed from a rank that does, or,
  when no rank does, every rank restores the last committed checkpoint. The host runs ahead
  of the device, so a member lost during a step's collective almost always spoils every
  survivor: the job then loses the work since the last checkpoint instead of at most the
  step in flight. So this mode needs a checkpoint, and it is worth it only where the
  per-step wait costs more than that. The step agreement (its flags are read one step
  late) and the checkpoint staging (which waits for the stream anyway) check the flag in
  this mode too, so a garbage agreement is never acted on and a garbage state is never
  saved.

gloo needs neither: its collectives run on the host and fail in the aborted call itself.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch

from elastic_errors import ConfigError

__all__ = ["STEP_FENCE_ENV", "StepFence", "step_fence_from_env"]

logger = logging.getLogger(__name__)

STEP_FENCE_ENV: Final = "ELASTIC_NCCL_STEP_FENCE"
"""``1`` (default): wait for the stream before each optimizer step with NCCL in place; ``0``:
check later, without waiting (see the module docstring for the trade-off)."""

#: Steps the host may run ahead of the device before the fence waits for the oldest one.
_MAX_PENDING: Final = 64


class _Guard(Protocol):
    """What the fence needs of :class:`~elastic.inplace.abort.WorldAbort`."""

    @property
    def aborted(self) -> bool: ...

    def check(self) -> None: ...


def step_fence_from_env() -> bool:
    """Whether the per-step wait is on (``ELASTIC_NCCL_STEP_FENCE``, default ``1``).

    Raises:
        ConfigError: If the variable holds anything but ``0`` or ``1``.
    """
    raw = os.environ.get(STEP_FENCE_ENV, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ConfigError(f"environment variable {STEP_FENCE_ENV} ({raw!r}) must be 1 (wait for "
                      "the stream before each optimizer step, the default) or 0 (check later; "
                      "an abort then rolls survivors back to the last checkpoint).")


@dataclass(slots=True)
class _Step:
    event: Any  # a torch.cuda.Event recorded before the step's optimizer kernels
    applied: bool = False  # the fence let the optimizer step run


class StepFence:
    """Decides, with NCCL in place, whether a step may be applied and whether this worker's
    state can still be trusted after its world was aborted (see the module docstring).

    Args:
        device: The worker's CUDA device (the stream waited on is its current stream).
        wait: ``True``: wait for the stream before every optimizer step; ``False``: check
            later, without waiting.
        current_stream: Returns the current stream of a device (tests pass a stand-in).
        new_event: Returns a fresh CUDA event (tests pass a stand-in).
    """

    def __init__(self, device: torch.device, *, wait: bool,
                 current_stream: Callable[[torch.device], Any] | None = None,
                 new_event: Callable[[], Any] | None = None) -> None:
        self.device = device
        self.wait = wait
        self._current_stream = current_stream or torch.cuda.current_stream
        self._new_event = new_event or torch.cuda.Event
        self._lock = threading.Lock()  # pending/suspect: the training and the abort thread
        self._pending: deque[_Step] = deque()
        self._suspect: list[_Step] = []

    def _stream(self) -> Any:
        return self._current_stream(self.device)

    def before_optimizer_step(self, guard: _Guard) -> None:
        """Lets the optimizer step run, or raises because the world was aborted.

        Raises:
            WorldAbortedError: If the world was aborted (the step must be abandoned).
        """
        if self.wait:
            self._stream().synchronize()
            guard.check()
            return
        guard.check()  # aborted already: nothing to record, the step is refused
        step = _Step(self._new_event())
        step.event.record(self._stream())
        oldest: _Step | None = None
        with self._lock:
            self._drop_finished()
            self._pending.append(step)
            if len(self._pending) > _MAX_PENDING:
                oldest = self._pending[0]
        # Checked after the step is listed: either on_abort saw it listed, or it ran before
        # this check and the flag, set before on_abort, refuses the step here.
        guard.check()
        step.applied = True
        if oldest is not None:  # the host is far ahead of the device: let it catch up
            oldest.event.synchronize()

    def _drop_finished(self) -> None:
        # Events of one stream finish in order: the finished ones are a prefix.
        while self._pending and self._pending[0].event.query():
            self._pending.popleft()

    def on_abort(self) -> None:
        """The world is being aborted (called after its flag is set, before any communicator
        is aborted): notes the steps whose collectives had not finished. Never raises."""
        with self._lock:
            for step in self._pending:
                try:
                    finished = bool(step.event.query())
                except Exception:  # cannot tell: count it as not finished
                    logger.debug("querying a step's event failed", exc_info=True)
                    finished = False
                if not finished:
                    self._suspect.append(step)
            self._pending.clear()

    def before_save(self, guard: _Guard) -> None:
        """Before state is staged for a checkpoint: in the checking-later mode, waits for the
        stream (staging waits for it anyway) and refuses a state of an aborted world.

        Raises:
            WorldAbortedError: If the world was aborted.
        """
        if self.wait:
            return  # every applied step was checked before it was applied
        self._stream().synchronize()
        guard.check()
        with self._lock:
            self._pending.clear()  # all finished while the flag was clear

    def settle(self, guard: _Guard | None) -> None:
        """The world's groups are about to be destroyed: resolves the steps still pending
        (waits for the stream unless the world was aborted, when :meth:`on_abort` did)."""
        with self._lock:
            if not self._pending:
                return
        if guard is not None and not guard.aborted:
            self._stream().synchronize()
        with self._lock:
            self._pending.clear()

    @property
    def spoiled(self) -> bool:
        """Whether this worker applied a step whose collective an abort cut short: its state
        is garbage until a heal or a restore replaces it."""
        with self._lock:
            return any(step.applied for step in self._suspect)

    def replaced(self) -> None:
        """This worker's state was replaced (healed, restored, or found sound)."""
        with self._lock:
            self._suspect.clear()
