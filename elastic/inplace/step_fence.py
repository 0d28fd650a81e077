"""Keeping a step computed on an aborted NCCL collective from counting: the step fence.

Aborting an NCCL communicator (:mod:`~elastic.inplace.abort`) does not raise in the training
thread for work already queued: the collective's kernels are released and their output is
garbage. NCCL leaves no flag on the device, so nothing queued after the collective can tell.
Something must keep a survivor from applying such a step and then offering its state to
the others in a heal. What a world abort guarantees, and every mode below rests on: the
world's abort flag (:attr:`WorldAbort.aborted`) is set, and :meth:`StepFence.on_abort`
has run, *before* any communicator is aborted. So a stream that the host saw finish while
the flag was clear finished on real collectives. ``ELASTIC_NCCL_STEP_FENCE`` chooses how
that is seen:

* ``auto`` (the default): ``device`` where the loop allows it (the managed loop with an
  optimizer that can skip a step on the device, ``fused=True``), ``1`` otherwise.
* ``device``, **the step gated on the device**: :meth:`on_abort` also writes ``1`` into a
  word of pinned host memory (one per world). Before each optimizer step the host only
  queues, on the step's stream, a copy of that word into a device slot, and hands the slot
  to the optimizer as its ``found_inf`` (the flag ``GradScaler`` uses: a fused optimizer
  skips its whole update, step count included, when it is 1). The copy reads host memory
  when the stream reaches it, after the step's gradient all-reduces: a collective that an
  abort cut short ends after the flag was written, so its step reads 1 and is skipped on
  the device; a step that reads 0 was computed on real collectives. The host never waits,
  but it runs ahead of the device: it may have finished the bookkeeping of steps the device
  then skipped. So each step keeps a snapshot of the loop's host state (its step, data
  cursor, scheduler and learning rates), and when the world is dropped (:meth:`settle`) the
  host waits for the stream (the abort released it), reads the slots of the steps not yet
  confirmed, and the loop rewinds to the first skipped one (:meth:`rewind_point`). A
  survivor loses at most the step in flight, as with ``1``. A step is confirmed without a
  wait once its event is done while the flag is still clear.
* ``1``, **a host wait before every optimizer step**: the host waits for the current stream
  (the step's gradient all-reduces are on it: DDP makes the stream wait for them at the end
  of backward), then checks the flag. A step of an aborted world raises and is abandoned
  before anything is applied; a survivor loses at most the step in flight. The cost: the
  host stops running ahead of the device once per step. While it waits for the backward,
  it cannot queue the optimizer step and the next forward, so the GPU idles for as long as
  the host takes to queue the next kernels (0.8 ms a step, 2 %, measured on an H200 with a
  219M-parameter GPT). A loop that already waits once per step (``loss.item()``,
  ``GradScaler``, clipping with ``error_if_nonfinite``) pays nothing more.
* ``0``, **checking later, without waiting**: before each optimizer step a CUDA event is
  recorded on the stream and the step is applied at once. Events found finished later
  (polled without waiting) clear their steps. When the world is aborted, :meth:`on_abort`
  first notes which recorded steps had not finished. A survivor that applied one of them
  holds garbage: it reports no state in the heal and is healed from a rank that does, or,
  when no rank does, every rank restores the last committed checkpoint. The host runs ahead
  of the device, so a member lost during a step's collective almost always spoils every
  survivor: the job then loses the work since the last checkpoint instead of at most the
  step in flight. So this mode needs a checkpoint.

In the ``device`` and ``0`` modes the step agreement (its flags are read one step late) and
the checkpoint staging check the flag too, so a garbage agreement is never acted on and the
state of a skipped or garbage step is never saved. gloo needs none of this: its collectives
run on the host and fail in the aborted call itself.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch

from elastic_errors import ConfigError

__all__ = ["STEP_FENCE_ENV", "FenceMode", "StepFence", "step_fence_from_env"]

logger = logging.getLogger(__name__)

STEP_FENCE_ENV: Final = "ELASTIC_NCCL_STEP_FENCE"
"""``auto`` (default), ``device``, ``1`` or ``0``: how a step of an aborted NCCL world is kept
from counting (see the module docstring for the trade-offs)."""

#: Steps the host may run ahead of the device before the fence waits for the oldest one.
_MAX_PENDING: Final = 64
#: Device slots of the gated steps (more than _MAX_PENDING: a slot is never reused while
#: its step is pending).
_SLOTS: Final = 2 * _MAX_PENDING
#: How long dropping a world waits for its stream before the state counts as unknown.
SETTLE_TIMEOUT_S: Final = 60.0


class FenceMode(str, enum.Enum):
    """The values of ``ELASTIC_NCCL_STEP_FENCE`` (see the module docstring)."""

    AUTO = "auto"
    DEVICE = "device"
    WAIT = "1"
    LATER = "0"


class _Guard(Protocol):
    """What the fence needs of :class:`~elastic.inplace.abort.WorldAbort`."""

    @property
    def aborted(self) -> bool: ...

    def check(self) -> None: ...

    def release(self) -> None: ...


def step_fence_from_env() -> FenceMode:
    """The fence ``ELASTIC_NCCL_STEP_FENCE`` asks for (default ``auto``).

    Raises:
        ConfigError: If the variable holds anything else than ``auto``, ``device``, ``1``
            or ``0``.
    """
    raw = os.environ.get(STEP_FENCE_ENV, "").strip().lower()
    if raw == "":
        return FenceMode.AUTO
    try:
        return FenceMode(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {STEP_FENCE_ENV} ({raw!r}) must be auto (the default: "
            "the device gate where the loop allows it, else 1), device (skip a step of an "
            "aborted world on the device), 1 (wait for the stream before each optimizer "
            "step) or 0 (check later; an abort then rolls survivors back to the last "
            "checkpoint).") from None


@dataclass(slots=True)
class _Step:
    event: Any  # a torch.cuda.Event recorded before (0) or after the gate (device)
    applied: bool = False  # the fence let the optimizer step run
    slot: int = -1  # device mode: the step's gate slot
    undo: Any = None  # device mode: the loop's host state at the start of the step


@dataclass(slots=True)
class _Gate:
    """One world's gate: the host word its abort writes and the device slots of its steps."""

    flag: torch.Tensor  # 0-dim float32, pinned host memory: 1.0 once the world is aborted
    slots: torch.Tensor  # float32 on the device: each gated step's copy of the flag
    next: int = 0


def _gate_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    flag = torch.zeros((), dtype=torch.float32, pin_memory=device.type == "cuda")
    return flag, torch.zeros(_SLOTS, dtype=torch.float32, device=device)


def _queue_copy(slot: torch.Tensor, flag: torch.Tensor) -> None:
    # From pinned memory the copy is a DMA that reads the word when the stream reaches it.
    slot.copy_(flag, non_blocking=True)


class StepFence:
    """Decides, with NCCL in place, whether a step may be applied and whether this worker's
    state can still be trusted after its world was aborted (see the module docstring).

    Args:
        device: The worker's CUDA device (the stream used is its current stream).
        mode: :class:`FenceMode` (``auto`` acts as ``1`` until :meth:`configure` resolves it).
        current_stream: Returns the current stream of a device (tests pass a stand-in).
        new_event: Returns a fresh CUDA event (tests pass a stand-in).
        gate_tensors: Device mode: returns a world's ``(flag, slots)`` (tests pass CPU ones).
        queue_copy: Device mode: queues ``slot <- flag`` on the current stream (tests pass a
            stand-in that runs it when their stream does).
    """

    def __init__(self, device: torch.device, *, mode: FenceMode | str,
                 current_stream: Callable[[torch.device], Any] | None = None,
                 new_event: Callable[[], Any] | None = None,
                 gate_tensors: Callable[[torch.device],
                                        tuple[torch.Tensor, torch.Tensor]] | None = None,
                 queue_copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.device = device
        self.mode = FenceMode(mode)
        self._requested = self.mode  # what configure() resolves again for each loop
        self._current_stream = current_stream or torch.cuda.current_stream
        self._new_event = new_event or torch.cuda.Event
        self._gate_tensors = gate_tensors or _gate_tensors
        self._queue_copy = queue_copy or _queue_copy
        self._lock = threading.Lock()  # pending/suspect/gate: the training and abort threads
        self._pending: deque[_Step] = deque()
        self._suspect: list[_Step] = []
        self._gate: _Gate | None = None  # device mode: the current world's
        self._gate_aborted = False  # device mode: the current gate's flag was written
        self._unresolved = False  # device mode: a dropped world's gates could not be read
        self._rewind: Any = None  # device mode: the undo of the first step the device skipped
        # id(optimizer) -> (optimizer, whether it had a found_inf, that found_inf)
        self._set_found_inf: dict[int, tuple[Any, bool, Any]] = {}

    @property
    def wait(self) -> bool:
        """Whether the host waits for the stream before every optimizer step."""
        return self.mode in (FenceMode.WAIT, FenceMode.AUTO)

    def configure(self, gate_blocker: str | None) -> None:
        """Resolves ``auto`` once the loop is known.

        Args:
            gate_blocker: Why the loop's steps cannot be gated on the device (``None``: they
                can): ``auto`` then waits on the host, and ``device`` is refused.

        Raises:
            ConfigError: ``device`` was asked for and ``gate_blocker`` says why it cannot be.
        """
        if self._requested is FenceMode.DEVICE and gate_blocker is not None:
            raise ConfigError(
                f"{STEP_FENCE_ENV}=device cannot gate this loop's steps on the device "
                f"({gate_blocker}); use the managed loop with a fused optimizer, or set "
                f"{STEP_FENCE_ENV}=1.")
        if self._requested is FenceMode.AUTO:
            self.mode = FenceMode.WAIT if gate_blocker is not None else FenceMode.DEVICE
            logger.info("step fence: %s%s", "device gate" if gate_blocker is None else
                        "host wait before each optimizer step",
                        f" ({gate_blocker})" if gate_blocker else "")

    def _stream(self) -> Any:
        return self._current_stream(self.device)

    def before_optimizer_step(self, guard: _Guard, optimizer: Any = None,
                              snapshot: Callable[[], Any] | None = None) -> None:
        """Lets the optimizer step run, or raises because the world was aborted.

        Args:
            guard: The world's abort.
            optimizer: Device mode: the optimizer about to step (it gets the gate as its
                ``found_inf``; :meth:`after_optimizer_step` takes it back).
            snapshot: Device mode: returns the loop's host state at the start of the step
                (what :meth:`rewind_point` gives back if the device skips it).

        Raises:
            WorldAbortedError: If the world was aborted (the step must be abandoned).
        """
        if (self.mode is FenceMode.DEVICE and snapshot is not None
                and getattr(optimizer, "_step_supports_amp_scaling", False)):
            self._gate_step(guard, optimizer, snapshot)
            return
        if self.mode is not FenceMode.LATER:  # wait, or a step the device mode cannot gate
            self._stream().synchronize()
            guard.check()
            return
        guard.check()  # aborted already: nothing to record, the step is refused
        step = _Step(self._new_event())
        step.event.record(self._stream())
        self._list(step)
        # Checked after the step is listed: either on_abort saw it listed, or it ran before
        # this check and the flag, set before on_abort, refuses the step here.
        guard.check()
        step.applied = True

    def _gate_step(self, guard: _Guard, optimizer: Any, snapshot: Callable[[], Any]) -> None:
        guard.check()  # aborted already: the step is refused on the host
        with self._lock:
            gate = self._gate
            if gate is None:  # the world's first gated step
                flag, slots = self._gate_tensors(self.device)
                if self._gate_aborted:  # on_abort ran before there was a flag to write
                    flag.fill_(1.0)
                gate = self._gate = _Gate(flag, slots)
            slot = gate.next
            gate.next = (slot + 1) % _SLOTS
        found = gate.slots[slot]
        self._queue_copy(found, gate.flag)
        step = _Step(self._new_event(), slot=slot, undo=snapshot())
        step.event.record(self._stream())
        self._list(step)
        self.after_optimizer_step(optimizer)  # a step that raised left the gate on it
        own = getattr(optimizer, "found_inf", None)  # GradScaler's, when it steps
        self._set_found_inf[id(optimizer)] = (optimizer, hasattr(optimizer, "found_inf"), own)
        optimizer.found_inf = found if own is None else torch.maximum(own, found)
        step.applied = True

    def after_optimizer_step(self, optimizer: Any) -> None:
        """Gives the optimizer back the ``found_inf`` it had before the gated step."""
        had = self._set_found_inf.pop(id(optimizer), None)
        if had is None:
            return
        if had[1]:
            optimizer.found_inf = had[2]
        else:
            with contextlib.suppress(AttributeError):  # GradScaler took it back already
                del optimizer.found_inf

    def _list(self, step: _Step) -> None:
        oldest: _Step | None = None
        with self._lock:
            self._drop_finished()
            self._pending.append(step)
            if len(self._pending) > _MAX_PENDING:
                oldest = self._pending[0]
        if oldest is not None:  # the host is far ahead of the device: let it catch up
            oldest.event.synchronize()

    def _drop_finished(self) -> None:
        # Events of one stream finish in order: the finished ones are a prefix. In device
        # mode a finished step is confirmed only while the flag is clear: its gate read 0.
        while self._pending and self._pending[0].event.query() and not self._gate_aborted:
            self._pending.popleft()

    def on_abort(self) -> None:
        """The world is being aborted (called after its flag is set, before any communicator
        is aborted): notes the steps whose collectives had not finished, and in device mode
        writes the gate's flag. Never raises."""
        with self._lock:
            if self.mode is FenceMode.DEVICE:
                self._gate_aborted = True
                if self._gate is not None:
                    try:
                        self._gate.flag.fill_(1.0)
                    except Exception:  # never: a write to host memory
                        logger.exception("writing the step gate's flag failed")
                return
            for step in self._pending:
                try:
                    finished = bool(step.event.query())
                except Exception:  # cannot tell: count it as not finished
                    logger.debug("querying a step's event failed", exc_info=True)
                    finished = False
                if not finished:
                    self._suspect.append(step)
            self._pending.clear()

    def before_save(self, guard: _Guard) -> Callable[[], None] | None:
        """Before state is staged for a checkpoint.

        Returns:
            Device mode: a check to run once the state's copy is complete (it raises
            :class:`WorldAbortedError` if the world was aborted by then: a step before the
            copy may have been skipped, so the state is not the step's). Otherwise ``None``.

        Raises:
            WorldAbortedError: Checking-later mode: the world was aborted (this waits for
                the stream first, which staging does anyway).
        """
        if self.mode is FenceMode.DEVICE:
            return guard.check
        if self.wait:
            return None  # every applied step was checked before it was applied
        self._stream().synchronize()
        guard.check()
        with self._lock:
            self._pending.clear()  # all finished while the flag was clear
        return None

    def settle(self, guard: _Guard | None) -> None:
        """The world's groups are about to be destroyed: resolves the steps still pending.

        Checking later, it waits for the stream unless the world was aborted (when
        :meth:`on_abort` noted what had not finished). In device mode it first releases the
        world's abort (so no late abort writes this world's flag), waits for the stream (at
        most :data:`SETTLE_TIMEOUT_S`: the abort released the collectives), reads the gates
        of the pending steps and keeps the first skipped step's undo for
        :meth:`rewind_point`; the next world gets a new gate.
        """
        if self.mode is FenceMode.DEVICE:
            self._settle_gates(guard)
            return
        with self._lock:
            if not self._pending:
                return
        if guard is not None and not guard.aborted:
            self._stream().synchronize()
        with self._lock:
            self._pending.clear()

    def _settle_gates(self, guard: _Guard | None) -> None:
        if guard is not None:
            guard.release()  # waits for an abort in progress; later ones only set its flag
        for optimizer, *_own in list(self._set_found_inf.values()):
            self.after_optimizer_step(optimizer)  # no gate of this world outlives it
        with self._lock:
            pending, gate = list(self._pending), self._gate
            self._pending.clear()
            # The next world gets a new flag: a gate copy of this one still queued reads
            # this world's own.
            self._gate, self._gate_aborted = None, False
        if not pending or gate is None:
            return
        marker = self._new_event()
        marker.record(self._stream())
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        pause = 0.001
        while not marker.query():
            if time.monotonic() >= deadline:
                logger.error("the stream did not finish within %.0fs of dropping the world: "
                             "this worker's state is unknown (it reports none in the heal)",
                             SETTLE_TIMEOUT_S)
                self._unresolved = True
                return
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        read = gate.slots[[step.slot for step in pending]].tolist()
        skipped = next((step for step, value in zip(pending, read, strict=True) if value != 0),
                       None)
        if skipped is not None and self._rewind is None:
            self._rewind = skipped.undo
            logger.warning("the device skipped %d step(s) of the aborted world: the loop "
                           "rewinds its host state to the first of them",
                           sum(1 for value in read if value != 0))

    def rewind_point(self) -> Any:
        """Device mode: the undo snapshot of the first step the device skipped when the last
        world was dropped (the loop rewinds its host state to it), or ``None``; taken once."""
        with self._lock:
            point, self._rewind = self._rewind, None
        return point

    @property
    def spoiled(self) -> bool:
        """Whether this worker applied a step whose collective an abort cut short, or cannot
        tell (device mode, a stream that did not finish): its state is garbage until a heal
        or a restore replaces it."""
        with self._lock:
            return self._unresolved or any(step.applied for step in self._suspect)

    def replaced(self) -> None:
        """This worker's state was replaced (healed, restored, or found sound)."""
        with self._lock:
            self._suspect.clear()
            self._unresolved = False
            self._rewind = None
