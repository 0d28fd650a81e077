"""Rewinding the managed loop's host state to a step the device skipped (the NCCL device gate).

With ``ELASTIC_NCCL_STEP_FENCE=device`` (:mod:`~elastic.inplace.step_fence`) the host queues a
step's optimizer update without waiting for the step's collectives, and goes on with the
step's bookkeeping: the step counter, the data cursor, the scheduler. If an abort then makes
the device skip that step, the host ran ahead of the state it holds. :class:`StepRewind` keeps
what the host changes per step (:class:`HostStep`, taken just before each optimizer step) and
puts it back, so that the loop resumes at the first step the device skipped. Only the managed
loop knows every piece of that host state, and only a fused optimizer skips its update on the
device (:meth:`StepRewind.step_gate_blocker` says when the gate cannot be used).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

    from elastic.loop.saves import SaveSchedule
    from elastic.sampler import ElasticSampler

__all__ = ["HostStep", "StepRewind"]

logger = logging.getLogger(__name__)

#: The managed loop's own state entries (``state=`` adds the script's).
_OWN_ENTRIES = frozenset({"train", "scheduler"})


@dataclass(frozen=True, slots=True)
class HostStep:
    """The managed loop's host state at the start of a step."""

    step: int
    sampler: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    groups: list[dict[str, Any]]  # the optimizer's hyperparameters (learning rates...)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value
            for key, value in group.items() if key != "params"}


class StepRewind:
    """The device gate's host snapshots and rewind, for :class:`~elastic.loop.ElasticLoop`."""

    step: int
    sampler: ElasticSampler | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    saves: SaveSchedule
    _user_state: dict[str, Any]
    _batches: Iterator[Any] | None

    if TYPE_CHECKING:
        def _record(self, event: str, **fields: Any) -> None: ...

    def step_gate_blocker(self) -> str | None:
        """Why this loop's optimizer steps cannot be gated on the device (``None``: they can).
        """
        if self.optimizer is None:
            return "the explicit way: the script's own per-step host state cannot be rewound"
        if not getattr(self.optimizer, "_step_supports_amp_scaling", False):
            return (f"{type(self.optimizer).__name__} cannot skip a step on the device; "
                    "construct it with fused=True")
        scheduler = self.scheduler
        if scheduler is not None and not (hasattr(scheduler, "state_dict")
                                          and hasattr(scheduler, "load_state_dict")):
            return f"the scheduler {type(scheduler).__name__} has no state_dict to rewind"
        others = sorted(k for k in self._user_state if k not in _OWN_ENTRIES)
        if others:
            return f"the state entries {others} may change on the host and cannot be rewound"
        return None

    def host_step(self) -> HostStep:
        """The host state at the start of this step (taken just before its optimizer step)."""
        assert self.optimizer is not None
        return HostStep(
            step=self.step,
            sampler=self.sampler.state_dict() if self.sampler is not None else None,
            scheduler=(copy.deepcopy(self.scheduler.state_dict())
                       if self.scheduler is not None else None),
            groups=[_hyperparameters(group) for group in self.optimizer.param_groups],
        )

    def rewind(self, point: HostStep) -> None:
        """Puts back the host state of ``point``: the device skipped that step and every later
        one (their bookkeeping ran ahead of it); training resumes at ``point.step``."""
        ahead = self.step
        self.step = point.step
        if self.sampler is not None and point.sampler is not None:
            self.sampler.load_state_dict(point.sampler)
        if self.scheduler is not None and point.scheduler is not None:
            self.scheduler.load_state_dict(point.scheduler)
        if self.optimizer is not None:
            for group, saved in zip(self.optimizer.param_groups, point.groups, strict=True):
                group.update(saved)
        self.saves.rewound(point.step)
        self._batches = None  # the loader starts again from the rewound cursor
        logger.warning("the device skipped steps %d to %d of an aborted world: resuming at "
                       "step %d", point.step, ahead - 1, point.step)
        self._record("rewound", step=point.step, ahead=ahead)
