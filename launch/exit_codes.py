"""``elastic-run``'s exit codes and name, shared by the command line and the runner."""

from __future__ import annotations

from typing import Final

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_RENDEZVOUS", "EXIT_WORKERS_FAILED", "PROG"]

PROG: Final = "elastic-run"

EXIT_OK: Final = 0
"""The job (or this node's part of it) finished, or the node left on a notice."""
EXIT_WORKERS_FAILED: Final = 1
"""The training script failed (its error is the last line), or this node's crash budget ran out."""
EXIT_BAD_INPUT: Final = 2
"""A flag or value was refused before anything started."""
EXIT_RENDEZVOUS: Final = 3
"""etcd or the rendezvous could not be used, or no world could form in time."""
