"""Drains: a SIGTERM (a preemption notice, or the agent restarting the world) becomes "save
now and stop" at a step boundary that every rank agrees on.

In restart mode the node agent asks its workers to stop with SIGTERM: on a preemption notice
(its own node's), and when the world changes under them. Only the signalled ranks hear it,
yet the final checkpoint needs every rank, so the request is agreed on the way
``ElasticLoop`` agrees on it: a small asynchronous all-reduce (MAX) read one agreement late
(:class:`~elastic.boundary_flags.BoundaryFlags`), about one every 50 ms
(:class:`~elastic.boundary_flags.AgreementCadence`). Every rank calls :meth:`at_step_end` at
every step boundary, and every rank gets the same answer at the same step.

The handler is installed only once training starts (:meth:`install`): until the worker holds
the job's state it has nothing to save, and a SIGTERM must end it at once (the agent
restarting a world whose workers are still starting).
"""

from __future__ import annotations

from typing import Final

import torch
import torch.distributed as dist

from elastic.boundary_flags import AgreementCadence, BoundaryFlags
from elastic.loop.signals import DrainSignal

__all__ = ["DRAINED_EXIT_CODE", "DrainAgreement", "Drained"]

DRAINED_EXIT_CODE: Final = 143
"""A drained worker's exit code (``128 + SIGTERM``, as ``examples/train.py``): a stop, not a
failure, and not the 0 that tells a launcher the worker finished the job."""


class Drained(SystemExit):
    """Ends a worker that drained, once its final checkpoint is committed."""

    def __init__(self, step: int) -> None:
        super().__init__(DRAINED_EXIT_CODE)
        self.step = step


class DrainAgreement:
    """A drain request, and the agreement of every rank on the step that acts on it.

    Args:
        device: Where the training group's collectives run (CUDA with NCCL, else CPU).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.signal = DrainSignal()
        self._flags: BoundaryFlags | None = None
        self._cadence = AgreementCadence()
        #: Whether the ranks agreed to drain.
        self.agreed = False

    def install(self) -> None:
        """Makes SIGTERM request a drain (from now on; main thread only)."""
        self.signal.install()

    def uninstall(self) -> None:
        """Restores the SIGTERM handler that was there before :meth:`install`."""
        self.signal.uninstall()

    def request(self) -> None:
        """Asks for a drain (what SIGTERM does)."""
        self.signal.request()

    @property
    def requested(self) -> bool:
        """Whether this rank was asked to drain."""
        return self.signal.requested

    def at_step_end(self, step: int) -> bool:
        """Called by every rank after every optimizer step; ``True`` when the ranks agreed to
        drain at this step (the same step on every rank).

        Args:
            step: Optimizer steps completed.

        Raises:
            RuntimeError: If the agreement's collective failed (a peer died).
        """
        if self.agreed:
            return True
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.agreed = self.requested
            return self.agreed
        if not self._cadence.due(step):
            return False
        if self._flags is None:
            self._flags = BoundaryFlags(1, self.device)
        agreed = self._flags.exchange([self.requested], self._cadence.step_time(step))
        if agreed is None:
            self._cadence.agreed(step, 0.0)
            return False
        self._cadence.agreed(step, self._flags.agreed_measure)
        self.agreed = agreed[0]
        return self.agreed

    def settle(self) -> None:
        """Waits for the agreement in flight (so that no collective of ours outlives the
        training loop); never raises (the loop is ending, maybe of a peer's failure)."""
        flags, self._flags = self._flags, None
        if flags is None:
            return
        try:
            flags.flush()
        except Exception:  # a peer died meanwhile: nothing left to agree on
            flags.reset()
