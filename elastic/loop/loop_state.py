"""The loop's own checkpointed state: step, global batch, RNG states and the data cursor."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["LOOP_KEY", "LoopState", "optimizers_in", "python_rng_state"]

LOOP_KEY = "elastic"
"""The state key the loop saves itself under (reserved)."""


class _Loop(Protocol):
    """What :class:`LoopState` reads of the loop (``ElasticLoop``)."""

    step: int
    global_batch_size: int
    sampler: Any

    def _apply_loaded(self, state: Mapping[str, Any]) -> None: ...


class LoopState(Stateful):
    """Step, data cursor, global batch and RNG state, saved under :data:`LOOP_KEY`."""

    def __init__(self, loop: _Loop) -> None:
        self._loop = loop

    def state_dict(self) -> dict[str, Any]:
        loop = self._loop
        state: dict[str, Any] = {
            "step": loop.step,
            "global_batch_size": loop.global_batch_size,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda_rng"] = torch.cuda.get_rng_state()
        if loop.sampler is not None:
            state["sampler"] = loop.sampler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loop._apply_loaded(state_dict)


def python_rng_state(value: Any) -> tuple[Any, ...]:
    """``random.setstate``'s tuple nesting, from the lists a checkpoint round trip gives."""
    if isinstance(value, list):
        return tuple(python_rng_state(v) if isinstance(v, list) else v for v in value)
    return tuple(value)


def optimizers_in(values: Iterable[Any]) -> list[torch.optim.Optimizer]:
    """The optimizers among checkpointed state entries (e.g. ``ModelOptimizerState``)."""
    found: list[torch.optim.Optimizer] = []
    for value in values:
        for candidate in (value, getattr(value, "optimizer", None)):
            if isinstance(candidate, torch.optim.Optimizer) and candidate not in found:
                found.append(candidate)
    return found
