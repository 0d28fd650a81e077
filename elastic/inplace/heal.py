"""Agree on the step to continue from, and copy state from a survivor to whoever is behind.

Resolution of a partial step (a step some ranks completed and others did not): a rank's
step counter counts the optimizer steps it *completed* (``ElasticLoop.end_step`` increments
it after ``optimizer.step()``), and a rank can only complete step ``s`` once the gradient
all-reduce of ``s`` returned, i.e. with every rank's contribution. Any rank holding step
``s`` therefore holds the correct state after ``s``. The new world all-gathers every rank's
step (``-1``: no state, a newcomer); the maximum wins, the lowest rank holding it is the
source, and it broadcasts its full state (model, optimizer, user state, loop step, RNG and
sampler cursor) to the new world; ranks behind it load it. Lost work is at most the step in
flight. Storage is read only when no rank holds state (a fresh job, or every worker died).

The broadcast runs on the gloo checkpoint group with CPU tensors (``torch.save`` bytes), so it
works the same under NCCL. It copies the whole state once per heal; for large models a
per-tensor broadcast would avoid the serialisation copy (not needed at this repository's
scales). Receivers load with ``weights_only=True``: a peer cannot make them run code.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HealResult", "agree_and_heal", "dump_state", "load_state"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealResult:
    """What the agreement decided.

    Attributes:
        step: The step every rank continues from (``-1``: no rank holds state).
        source: Rank that sent its state (``-1``: nothing was sent).
        steps: Each rank's step before the heal.
        received: Whether this rank loaded the source's state.
    """

    step: int
    source: int
    steps: tuple[int, ...]
    received: bool


def dump_state(state: Mapping[str, Any]) -> bytes:
    """Serialises ``state``: ``Stateful`` values by their ``state_dict()``, others as they are."""
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    return buffer.getvalue()


def load_state(state: Mapping[str, Any], payload: bytes) -> None:
    """Loads what :func:`dump_state` wrote into ``state`` in place."""
    plain = torch.load(io.BytesIO(payload), weights_only=True)
    for key, target in state.items():
        value = plain[key]
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        elif isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        elif isinstance(target, dict):
            target.clear()
            target.update(value)
        else:
            raise TypeError(
                f"state entry {key!r} ({type(target).__name__}) cannot be healed in place; "
                "wrap it in an object with state_dict()/load_state_dict()."
            )


def agree_and_heal(
    my_step: int, state: Mapping[str, Any], group: dist.ProcessGroup
) -> HealResult:
    """The collective agreement and broadcast described in the module docstring.

    Every rank of ``group`` must call it with its completed step (``-1`` without state).
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([my_step], dtype=torch.int64), group=group)
    steps = tuple(int(t.item()) for t in gathered)
    best = max(steps)
    if best < 0 or min(steps) == best:
        return HealResult(step=best, source=-1, steps=steps, received=False)
    source = steps.index(best)
    source_global = dist.get_global_rank(group, source)
    if rank == source:
        payload = dump_state(state)
        size = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=source_global, group=group)
    if rank == source:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=source_global, group=group)
    received = my_step < best
    if received:
        load_state(state, data.numpy().tobytes())
    logger.info("healed at step %d from rank %d (steps %s, %d bytes)", best, source, steps,
                int(size.item()))
    return HealResult(step=best, source=source, steps=steps, received=received)
