"""When the loop saves, and how long training waits for a save to commit.

Saves are asynchronous: a save started after step ``s`` commits while steps ``s + 1, ...``
train, and until it has committed a failure falls back to the save before it. The loop waits
for a save's commit at the latest ``max_commit_lag`` steps after starting it (by default the
interval, where the next save would wait for it anyway, so steady-state training never
blocks unless persisting is slower than an interval). A failure therefore redoes at most
``checkpoint_interval + max_commit_lag`` completed steps. A save that fails to commit is
logged and training goes on; the bound then counts from the last save that did commit.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from elastic_errors import ConfigError

if TYPE_CHECKING:
    from checkpointing import CheckpointManager, SaveHandle

__all__ = ["SaveSchedule"]

logger = logging.getLogger(__name__)

Recorder = Callable[..., None]


class SaveSchedule:
    """Saves at the interval, at the end and on a drain; bounds the commit lag.

    Args:
        checkpoint: The manager (``None``: no checkpoints; every call does nothing).
        interval: Save every this many steps.
        max_commit_lag: Steps a save may run uncommitted before training waits for it.
        drain_timeout: How long a drain's final save may take to commit.
        record: Records ``checkpoint`` events (``record("checkpoint", **fields)``).

    Raises:
        ConfigError: On invalid values.
    """

    def __init__(self, checkpoint: CheckpointManager | None, *, interval: int,
                 max_commit_lag: int | None, drain_timeout: timedelta,
                 record: Recorder) -> None:
        if interval < 1:
            raise ConfigError(f"checkpoint_interval ({interval}) must be at least 1.")
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
        self._record = record
        self._saved_step = -1
        self._uncommitted: SaveHandle | None = None
        #: Seconds the current step was blocked by saves and commit waits.
        self.blocked_s = 0.0
        #: Called before each save's state is staged; may raise to refuse it (in place with
        #: NCCL: the step fence's check that the state is sound).
        self.before_save: Callable[[], None] | None = None

    def restored(self, step: int) -> None:
        """The state was loaded at ``step`` (it needs no save again)."""
        self._saved_step = step

    def after_step(self, step: int, state: Mapping[str, Any], *, last: bool,
                   drained: bool, round_: int | None) -> None:
        """Saves if ``step`` is due (the interval, the last step, a drain) and waits for an
        overdue commit."""
        self.wait_overdue(step, round_)  # the previous save, before a new one replaces it
        if drained or last:
            self._save(step, state, final=True, drained=drained, round_=round_)
        elif step % self.interval == 0:
            self._save(step, state, final=False, drained=False, round_=round_)
        self.wait_overdue(step, round_)  # this step's save, when max_commit_lag is 0

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
        error = handle.committed.exception()
        if error is not None:
            logger.warning(
                "checkpoint of step %d did not commit (%s); until a later one does, a failure "
                "rolls back further than checkpoint_interval + max_commit_lag steps",
                handle.step, error,
            )

    def _save(self, step: int, state: Mapping[str, Any], *, final: bool, drained: bool,
              round_: int | None) -> None:
        if self.checkpoint is None or self._saved_step == step:
            return
        if self.before_save is not None:
            self.before_save()
        self._saved_step = step
        started = time.monotonic()
        handle = self.checkpoint.save(step, state)
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
