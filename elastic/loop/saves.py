"""When the loop saves, and how long training waits for a save.

Saves are asynchronous: a save started after step ``s`` commits while steps ``s + 1, ...``
train, and until it has committed a failure falls back to the save before it. A save that
fails to commit is logged and training goes on; the bounds below then count from the last
save that did commit.

What happens when writing is slower than the interval is the **backpressure** policy:

* ``"wait"`` (the default): the loop waits for a save's commit at the latest
  ``max_commit_lag`` steps after starting it (by default the interval, where the next save
  would wait for it anyway, so training never waits unless writing is slower than an
  interval). A failure therefore redoes at most ``checkpoint_interval + max_commit_lag``
  completed steps.
* ``"defer"``: training never waits for a write. A save that falls due while the previous
  one is still being written (or while the staging buffers are still being allocated) is
  deferred, and recorded as ``checkpoint_deferred``; it is taken at the first step boundary
  after that write has finished, with the state of that step (deferred saves coalesce into
  one). One set of staging buffers suffices, and at most one save is in flight. A failure
  redoes at most ``max(interval, W) + W`` steps, ``W`` being the steps one write takes.

Staging: with a :class:`~checkpointing.CheckpointManager` the state's device-to-host copy runs
on a side stream while training goes on (``overlap``), and the training stream waits for it
(:meth:`SaveSchedule.hold_copy`) before the first kernel that may write a saved tensor: the
next step's start, or, when the loop knows that only its optimizer writes the saved tensors,
the next optimizer step. Each save's stall is recorded once known (``checkpoint_staged``):
the time the training thread spent in the save call plus the time the training stream
waited for the copy. The buffers are allocated in the background after the first step of
each world (:meth:`SaveSchedule.reserve`), before the first save is due.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from elastic_errors import ConfigError

if TYPE_CHECKING:
    from checkpointing import CheckpointManager, SaveHandle
    from checkpointing.staging import StagedCopy

__all__ = ["BACKPRESSURE", "SaveSchedule"]

logger = logging.getLogger(__name__)

Recorder = Callable[..., None]

BACKPRESSURE: Final = ("wait", "defer")
"""The backpressure policies (see the module docstring)."""


@dataclass(slots=True)
class _Stall:
    """A save whose stall is not known yet (its copy or the training stream's wait runs)."""

    step: int
    copy: StagedCopy
    blocked_s: float
    round: int | None


class SaveSchedule:
    """Saves at the interval, at the end and on a drain; bounds the commit lag or defers.

    Args:
        checkpoint: The manager (``None``: no checkpoints; every call does nothing).
        interval: Save every this many steps.
        max_commit_lag: Steps a save may run uncommitted before training waits for it
            (``"wait"`` only).
        drain_timeout: How long a drain's final save may take to commit.
        record: Records ``checkpoint`` events (``record("checkpoint", **fields)``).
        backpressure: ``"wait"`` or ``"defer"`` (see the module docstring).

    Raises:
        ConfigError: On invalid values.
    """

    def __init__(self, checkpoint: CheckpointManager | None, *, interval: int,
                 max_commit_lag: int | None, drain_timeout: timedelta,
                 record: Recorder, backpressure: str = "wait") -> None:
        if interval < 1:
            raise ConfigError(f"checkpoint_interval ({interval}) must be at least 1.")
        if backpressure not in BACKPRESSURE:
            raise ConfigError(f"save_backpressure ({backpressure!r}) must be 'wait' (bound the "
                              "lost work, waiting for slow writes) or 'defer' (never wait).")
        if backpressure == "defer" and max_commit_lag is not None:
            raise ConfigError(
                f"max_commit_lag ({max_commit_lag}) bounds lost work by waiting for commits, "
                "but save_backpressure='defer' never waits; pass one of them.")
        lag = interval if max_commit_lag is None else max_commit_lag
        if not 0 <= lag <= interval:
            # Above the interval it would change nothing: the next save waits for this one.
            raise ConfigError(
                f"max_commit_lag ({lag}) must be between 0 and checkpoint_interval "
                f"({interval}); pass None for the interval."
            )
        self.checkpoint = checkpoint
        self.interval = interval
        self.max_commit_lag = lag
        self.drain_timeout = drain_timeout
        self.backpressure = backpressure
        self._record = record
        self._saved_step = -1
        self._uncommitted: SaveHandle | None = None
        self._deferred: int | None = None  # the first due step a deferred save stands for
        self._copy: StagedCopy | None = None  # the last save's copy, until held
        self._stalls: list[_Stall] = []
        #: Seconds the current step was blocked by saves and commit waits.
        self.blocked_s = 0.0
        #: Called before each save's state is staged; may raise to refuse it, and may return
        #: a check to run once the copy is complete (in place with NCCL: the step fence's).
        self.before_save: Callable[[], Callable[[], None] | None] | None = None
        #: Whether the training stream waits for a save's copy only at the next optimizer
        #: step (the loop sets it when nothing else writes the saved tensors); else at the
        #: next step's start.
        self.hold_at_optimizer_step = False
        #: Whether the staging buffers are to be allocated after the next step (the loop
        #: sets it again in a new world: shards may change shape).
        self.reserve_due = True

    @property
    def _manager(self) -> Any:
        """The checkpoint if it is a real manager (stand-ins in tests lack the extensions)."""
        from checkpointing import CheckpointManager

        return self.checkpoint if isinstance(self.checkpoint, CheckpointManager) else None

    def restored(self, step: int) -> None:
        """The state was loaded at ``step`` (it needs no save again)."""
        self._saved_step = step

    def rewound(self, step: int) -> None:
        """The loop's host state went back to ``step`` (the device skipped later steps): a
        save taken after it holds no step's state (its commit is refused) and is due again."""
        if self._saved_step > step:
            self._saved_step = -1
        if self._deferred is not None and self._deferred > step:
            self._deferred = None

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Allocates the staging buffers of ``state`` in the background, if due."""
        if not self.reserve_due:
            return
        self.reserve_due = False
        manager = self._manager
        if manager is not None:
            started = time.monotonic()
            nbytes = manager.reserve(state)
            if nbytes:
                logger.info("allocating %.2f GB of checkpoint staging buffers in the background "
                            "(%.3fs to start)", nbytes / 1e9, time.monotonic() - started)

    def before_step(self) -> None:
        """A step starts: the training stream waits for the last save's copy, unless that
        wait belongs at the optimizer step (:attr:`hold_at_optimizer_step`)."""
        if not self.hold_at_optimizer_step:
            self.hold_copy()

    def hold_copy(self) -> None:
        """Makes the training stream wait for the last save's device-to-host copy before
        anything queued from now on (the host does not wait)."""
        staged, self._copy = self._copy, None
        if staged is not None:
            staged.hold()

    def wait_copy(self) -> None:
        """Waits on the host for the last save's copy (before the state is read or replaced
        outside the step's stream order, as in a heal)."""
        staged = self._copy
        if staged is not None:
            staged.wait()

    def after_step(self, step: int, state: Mapping[str, Any], *, last: bool,
                   drained: bool, round_: int | None) -> None:
        """Saves if ``step`` is due (the interval, the last step, a drain; with ``"defer"``,
        a deferred save), waits for an overdue commit (``"wait"``), and records the stalls
        of earlier saves once they are known."""
        self._report_stalls()
        if self.backpressure == "wait":
            self.wait_overdue(step, round_)  # the previous save, before a new one replaces it
        else:
            self._reap()
        if drained or last:
            self._save(step, state, final=True, drained=drained, round_=round_)
        elif step % self.interval == 0 or self._deferred is not None:
            busy = self._busy() if self.backpressure == "defer" else None
            if busy is None:
                self._deferred = None
                self._save(step, state, final=False, drained=False, round_=round_)
            elif step % self.interval == 0:
                if self._deferred is None:
                    self._deferred = step
                logger.info("checkpoint of step %d deferred: %s", step, busy)
                self._record("checkpoint_deferred", round=round_, step=step, reason=busy)
        if self.backpressure == "wait":
            self.wait_overdue(step, round_)  # this step's save, when max_commit_lag is 0

    def _busy(self) -> str | None:
        manager = self._manager
        if manager is not None:
            return manager.busy()  # type: ignore[no-any-return]
        handle = self._uncommitted
        if handle is not None and not handle.committed.done():
            return f"the save of step {handle.step} is still being written"
        return None

    def _reap(self) -> None:
        """``"defer"``: forgets the previous save once it has finished (logging a failure)."""
        handle = self._uncommitted
        if handle is not None and handle.committed.done():
            self._uncommitted = None
            self._log_failure(handle)

    def settle(self, step: int, round_: int | None) -> None:
        """Waits for the save in flight to commit (or fail), whatever its age.

        In place, called by every member of a world before a planned change tears its
        groups down: the save's collectives run on them.
        """
        self.wait_overdue(step, round_, force=True)

    def wait_overdue(self, step: int, round_: int | None, *, force: bool = False) -> None:
        """Waits for the in-flight save once it is ``max_commit_lag`` steps old.

        Every rank waits for its own handle; they resolve together (the commit is one
        collective).
        """
        handle = self._uncommitted
        if handle is None or (not force and step - handle.step < self.max_commit_lag):
            return
        self._uncommitted = None
        if not handle.committed.done():
            started = time.monotonic()
            handle.committed.exception()
            waited = time.monotonic() - started
            logger.info("waited %.2fs at step %d for the checkpoint of step %d to commit",
                        waited, step, handle.step)
            self.blocked_s += waited
            self._record("checkpoint", round=round_, step=handle.step,
                         blocked_s=round(waited, 4), final=False, wait="commit")
        self._log_failure(handle)

    @staticmethod
    def _log_failure(handle: SaveHandle) -> None:
        error = handle.committed.exception()
        if error is not None:
            logger.warning(
                "checkpoint of step %d did not commit (%s); until a later one does, a failure "
                "rolls back further than the save schedule bounds",
                handle.step, error,
            )

    def _save(self, step: int, state: Mapping[str, Any], *, final: bool, drained: bool,
              round_: int | None) -> None:
        if self.checkpoint is None or self._saved_step == step:
            return
        after_copy = self.before_save() if self.before_save is not None else None
        self._saved_step = step
        self.hold_copy()  # an older copy (never held: no step since) before a new one
        started = time.monotonic()
        manager = self._manager
        if manager is not None:
            handle = manager.save(step, state, overlap=not final, after_copy=after_copy)
        else:
            handle = self.checkpoint.save(step, state)
        issued = time.monotonic() - started
        # A final save does its own waiting (bounded by drain_timeout when draining).
        self._uncommitted = None if final else handle
        if final:
            timeout = self.drain_timeout.total_seconds() if drained else None
            with contextlib.suppress(Exception):
                handle.committed.result(timeout=timeout)
            if handle.committed.done() and handle.committed.exception() is None:
                logger.info("final checkpoint at step %d committed in %.2fs", step,
                            time.monotonic() - started)
            else:
                logger.warning("final checkpoint at step %d did not commit in time", step)
        blocked = time.monotonic() - started
        self.blocked_s += blocked
        self._record("checkpoint", round=round_, step=step, blocked_s=round(blocked, 4),
                     final=final)
        copied = getattr(handle, "copy", None)
        if copied is not None and not final:
            self._copy = copied
            self._stalls.append(_Stall(step, copied, issued, round_))
            self._report_stalls()

    def _report_stalls(self) -> None:
        """Records ``checkpoint_staged`` for each save whose stall is now known."""
        waiting = []
        for stall in self._stalls:
            timings = stall.copy.timings()
            if timings is None:
                waiting.append(stall)
                continue
            copy_s, held_s = timings
            if not stall.copy.overlapped:
                copy_s = stall.copy.stage_s
            self._record("checkpoint_staged", round=stall.round, step=stall.step,
                         bytes=stall.copy.nbytes, stage_s=round(stall.copy.stage_s, 4),
                         copy_s=round(copy_s, 4), held_s=round(held_s, 4),
                         stall_s=round(stall.blocked_s + held_s, 4))
        self._stalls = waiting[-8:]  # a copy never held (no step after it) is not waited for
