"""What the managed loop's model returns in a step a peer's failure abandoned, when the model
cannot run alone.

A DDP model's forward has no collective, so an abandoned step's forward just runs locally
(its output is then ignored). A sharded model's forward *is* collectives (FSDP gathers each
layer's parameters), so it cannot run on a broken world. The script's code between the
model's call and ``loop.backward()`` still runs, though (``loss = loss_fn(loop.model(x), y)``):
the model returns an :class:`AbandonedOutput` instead, a NaN scalar on which every torch
operation gives another :class:`AbandonedOutput` (whatever the shapes), and which
``loop.backward()`` ignores. ``loss.item()`` is NaN.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["AbandonedOutput", "abandoned_output"]


def _plain(value: Any) -> Any:
    """``value`` with every :class:`AbandonedOutput` in it replaced by a plain NaN scalar
    (so the operation runs on plain tensors, without dispatching back here)."""
    if isinstance(value, AbandonedOutput):
        return torch.tensor(float("nan"))
    if isinstance(value, tuple | list):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class AbandonedOutput(torch.Tensor):
    """A NaN scalar that absorbs every operation (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # broadcasting a scalar against the targets
            try:
                result = func(*_plain(tuple(args)), **_plain(dict(kwargs or {})))
            except Exception:
                return abandoned_output()
        if type(result) is torch.Tensor:
            return result.as_subclass(AbandonedOutput)
        return result


def abandoned_output() -> AbandonedOutput:
    """A fresh :class:`AbandonedOutput`."""
    return torch.tensor(float("nan")).as_subclass(AbandonedOutput)
