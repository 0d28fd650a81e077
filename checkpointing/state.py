"""A DCP ``Stateful`` for a model, its optimizer and small extra state."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class ModelOptimizerState(Stateful):
    """Model + optimizer (+ extra) state, through torch's distributed-aware state_dict API.

    ``get_state_dict`` gives FQN-keyed optimizer state, so a checkpoint re-shards across world
    sizes and parallelisms (DDP, FSDP2) without knowing parameter order.

    Args:
        model: The module (plain, DDP or FSDP-wrapped).
        optimizer: Its optimizer.
        extra: A mutable mapping of further state (step counter, sampler position...); it is
            updated in place on load.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        extra: MutableMapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra: MutableMapping[str, Any] = extra if extra is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"model", "optim", "extra"}`` state dicts."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "extra": dict(self.extra)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state produced by :meth:`state_dict` (possibly on another world size)."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        extra = state_dict.get("extra") or {}
        self.extra.clear()
        self.extra.update(extra)
