"""SIGTERM as a drain request, and DataLoader workers that do not die of it.

torchrun's agent (and elastic-run's, on a notice) signals the worker; the loop turns SIGTERM
into a flag that every rank agrees on at a step boundary, then saves and stops. A SIGTERM
sent to the worker's whole session also reaches its DataLoader worker processes, which would
exit on it and fail the main process with "DataLoader worker ... is killed by signal:
Terminated" instead of draining; :func:`shield_workers_from_sigterm` makes them ignore it
(they still stop when the main process shuts the loader down, and die with it on SIGKILL).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["DrainSignal", "shield_workers_from_sigterm"]


class DrainSignal:
    """A drain request: set by SIGTERM (when installed) or by :meth:`request`."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._previous: Any = None

    def install(self) -> None:
        """Makes SIGTERM request a drain (main thread only; elsewhere it does nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def uninstall(self) -> None:
        """Restores the previous SIGTERM handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the final save needs every rank, so it happens at an agreed boundary.
        self._flag.set()

    def request(self) -> None:
        """Asks for a drain (what SIGTERM does)."""
        self._flag.set()

    @property
    def requested(self) -> bool:
        """Whether a drain was asked for."""
        return self._flag.is_set()


class _IgnoreSigterm:
    """A ``worker_init_fn`` that ignores SIGTERM, then runs the user's one.

    A class rather than a closure so that it pickles for ``spawn``/``forkserver`` workers.
    """

    def __init__(self, inner: Callable[[int], None] | None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        # Runs after torch's own worker signal set-up, which makes a foreign SIGTERM fatal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.inner is not None:
            self.inner(worker_id)


def shield_workers_from_sigterm(loader: Iterable[Any]) -> None:
    """Makes ``loader``'s worker processes ignore SIGTERM (see the module docstring)."""
    if not isinstance(loader, DataLoader) or loader.num_workers == 0:
        return
    if not isinstance(loader.worker_init_fn, _IgnoreSigterm):
        loader.worker_init_fn = _IgnoreSigterm(loader.worker_init_fn)
