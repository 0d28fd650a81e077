"""A node's crash budget: how many worker crashes it absorbs, and how long it backs off.

A spot cluster runs for days; a single transient crash must not end it, and a worker that
crashes in a loop must not spin. Each node tolerates ``max_restarts`` crashes within a sliding
``window`` (default one hour), restarting after an exponential backoff (1 s, 2 s, 4 s, ...,
capped). A node whose crashes exceed the budget leaves the job the way a departing node does;
the others go on as long as they are at least ``--min-nodes``. Membership changes, evictions
ordered by the job and workers that died of a peer's failure are never charged.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from elastic_errors import ConfigError

__all__ = ["DEFAULT_MAX_RESTARTS", "DEFAULT_WINDOW_S", "CrashBudget"]

DEFAULT_MAX_RESTARTS: Final = 3
DEFAULT_WINDOW_S: Final = 3600.0
_BACKOFF_BASE_S: Final = 1.0
_BACKOFF_CAP_S: Final = 30.0


@dataclass
class CrashBudget:
    """Counts a node's crashes in a sliding window and says how long to back off.

    Args:
        max_restarts: Crashes tolerated within ``window``; one more exhausts the budget.
        window: Seconds a crash counts against the budget.
        backoff_base: Delay before the first restart (doubles with each recent crash).
        backoff_cap: The longest delay.

    Raises:
        ConfigError: On negative values.
    """

    max_restarts: int = DEFAULT_MAX_RESTARTS
    window: float = DEFAULT_WINDOW_S
    backoff_base: float = _BACKOFF_BASE_S
    backoff_cap: float = _BACKOFF_CAP_S
    _crashes: deque[float] = field(default_factory=deque)
    total: int = 0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts ({self.max_restarts}) must be at least 0.")
        if self.window <= 0:
            raise ConfigError(f"--restart-window ({self.window}) must be positive.")

    def _trim(self, now: float) -> None:
        while self._crashes and now - self._crashes[0] > self.window:
            self._crashes.popleft()

    def charge(self, now: float | None = None) -> float | None:
        """Records a crash; returns the backoff before restarting, or ``None`` if exhausted."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        self._crashes.append(now)
        self.total += 1
        recent = len(self._crashes)
        if recent > self.max_restarts:
            return None
        return float(min(self.backoff_cap, self.backoff_base * 2.0 ** (recent - 1)))

    def recent(self, now: float | None = None) -> int:
        """Crashes within the window."""
        self._trim(time.monotonic() if now is None else now)
        return len(self._crashes)
