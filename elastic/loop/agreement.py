"""Every rank agrees on draining, on a newer world and on refreshing a sharded model's peer
copies, at the same step, without a collective of its own at every step
(:class:`~elastic.boundary_flags.AgreementCadence`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic.boundary_flags import AgreementCadence, BoundaryFlags
from elastic.loop.signals import DrainSignal

if TYPE_CHECKING:
    from elastic.context import ElasticContext

__all__ = ["StepAgreement"]

_DRAIN, _NEWER_WORLD, _SNAPSHOT = 0, 1, 2  # _SNAPSHOT: a rank holds a refresh of copies off


class StepAgreement:
    """The step agreement of :class:`~elastic.loop.ElasticLoop`."""

    ctx: ElasticContext | None
    step: int
    max_steps: int
    _flags: BoundaryFlags | None
    _cadence: AgreementCadence
    _drain: DrainSignal
    _inplace: Any
    _snapshot_agreed: bool

    if TYPE_CHECKING:
        def _snapshot_flag(self) -> bool: ...

    def settle_collectives(self) -> None:
        """Waits for the boundary agreement in flight (its group is about to go)."""
        flags, self._flags = self._flags, None
        self._cadence.reset()
        if flags is not None:
            flags.flush()

    def _agree(self) -> bool:
        """At an agreement step (:class:`~elastic.boundary_flags.AgreementCadence`), this
        rank's flags go out and the previous agreement's, the same on every rank, come back."""
        if self.ctx is None or self.ctx.world_size == 1:
            newer = self._inplace is not None and self._inplace.change_pending()
            agreed: tuple[bool, ...] | None = (self._drain.requested, newer,
                                               self._snapshot_flag())
        else:
            if self.step >= self.max_steps:
                # The last step: start nothing new (no collective may outlive the loop).
                self.settle_collectives()
                return False
            if not self._cadence.due(self.step):
                return False
            newer = self._inplace is not None and self._inplace.change_pending()
            if self._flags is None:
                self._flags = BoundaryFlags(3, self.ctx.device, self.ctx.process_group)
            agreed = self._flags.exchange([self._drain.requested, newer, self._snapshot_flag()],
                                          self._cadence.step_time(self.step))
            if agreed is not None:
                if self._inplace is not None:
                    self._inplace.check_agreement()  # NCCL: flags of an aborted world are garbage
                self._cadence.agreed(self.step, self._flags.agreed_measure)
        if agreed is None:
            return False
        if agreed[_NEWER_WORLD] and self._inplace is not None:
            self._inplace.request("membership")
        if not agreed[_SNAPSHOT]:  # no rank held a refresh off
            self._snapshot_agreed = True
        return bool(agreed[_DRAIN])
