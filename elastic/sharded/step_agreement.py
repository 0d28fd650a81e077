"""HSDP: no rank applies an optimizer step until every rank of the world has its gradients.

Why it is needed: HSDP reduces each shard's gradients within its shard group and then across
its replica group, so no collective of a step spans the whole world. A rank lost near the end
of a backward can cut short the collectives of the groups it belonged to while the other
groups' collectives complete. The ranks of those other groups then apply step ``N`` and the
first ones stay at ``N - 1``. When every surviving holder of one shard is at ``N - 1`` and
every surviving holder of another is at ``N``, no step is held whole by the survivors, and
the heal has to read storage (:func:`elastic.sharded.reshard.choose_step`).

The fix is one all-reduce of a single element over the world, run by an optimizer pre-step
hook after the backward. It can complete on a rank only once every rank has entered it, that
is, once every rank has finished its own gradient collectives, so either every survivor
applies the step or none does. One case is left open. A rank lost *during* this all-reduce can
let it complete on some ranks and not others, since no protocol over a network that loses
peers is atomic. That window is one small collective instead of the whole end of the
backward, and it still ends in a correct restore from storage.

On NCCL the all-reduce is queued on the current stream without a host wait. The loop's host
wait before a sharded step (:mod:`elastic.inplace.step_fence`) comes after it, so a step
whose agreement an abort cut short is never applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["world_agreement_hook"]


def world_agreement_hook(group: Callable[[], dist.ProcessGroup | None],
                         device: Callable[[], torch.device]) -> Callable[..., None]:
    """An optimizer step pre-hook that all-reduces one element over ``group()``.

    Args:
        group: Returns the world's group when the hook runs (``None``: the default group);
            read at every step, because an in-place world change replaces it.
        device: Returns the device of the group's tensors (CUDA for NCCL).

    Returns:
        A hook for :meth:`torch.optim.Optimizer.register_step_pre_hook`. It raises what the
        collective raises when a peer is lost; the loop's step guard then abandons the step
        before anything is applied.
    """
    def hook(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        ready = torch.ones(1, dtype=torch.int32, device=device())
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group())

    return hook
