"""DistributedDataParallel on the current world, rebuilt when the world changes.

In place, a world's process groups are replaced at a reconfiguration, so a DDP built on the
old ones is useless; :class:`Replicas` keeps one DDP per model per world generation. Every
rank holds the same state after a heal, so DDP's initial broadcast is skipped in place.

:class:`ElasticModel` is what the managed loop (``loop.model``) hands the script: a module the
script can keep, whose forward runs the current world's DDP; a peer's failure inside that
forward (a buffer broadcast, SyncBatchNorm) abandons the step instead of failing the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from elastic.context import ElasticContext

__all__ = ["ElasticModel", "Replicas"]


class Replicas:
    """One ``DistributedDataParallel`` per model and world generation.

    Args:
        ctx: The worker's context (``None``: single process, models are returned as they are).
        in_place: Whether worlds change in place (DDP's initial broadcast is then skipped).
        on_bucket_rebuild: Called right before the forward in which a DDP rebuilds its
            buckets: the first forward of its second step (the first synced backward
            recorded the order gradients came in), which broadcasts the new bucket layout
            from rank 0, a collective of the forward, before any gradient is all-reduced.
            The in-place controller starts its progress clock there, so that a peer hung
            right before that forward is found like one hung before the gradient
            collective (otherwise the survivors wait out the backend's timeout).
        step: The loop's step counter (read when a DDP is built and at each forward).
    """

    def __init__(self, ctx: ElasticContext | None, *, in_place: bool,
                 on_bucket_rebuild: Callable[[], None] | None = None,
                 step: Callable[[], int] | None = None) -> None:
        self._ctx = ctx
        self._in_place = in_place
        self._on_bucket_rebuild = on_bucket_rebuild
        self._step = step
        self._cache: dict[int, tuple[int, nn.Module, nn.Module]] = {}

    def wrap(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """``DistributedDataParallel(model)`` on the current world (cached per world)."""
        if self._ctx is None or not dist.is_initialized():
            return model
        from torch.nn.parallel import DistributedDataParallel

        generation = self._ctx.generation
        cached = self._cache.get(id(model))
        if cached is not None and cached[0] == generation:
            return cached[2]
        if self._ctx.device.type == "cuda":
            kwargs.setdefault("device_ids", [self._ctx.device])
        if self._in_place:
            kwargs.setdefault("init_sync", False)
        wrapped = DistributedDataParallel(model, process_group=self._ctx.process_group,
                                          **kwargs)
        self._cache[id(model)] = (generation, model, wrapped)
        if self._on_bucket_rebuild is not None and self._step is not None:
            self._watch_bucket_rebuild(wrapped, self._on_bucket_rebuild, self._step)
        return wrapped

    @staticmethod
    def _watch_bucket_rebuild(wrapped: nn.Module, notify: Callable[[], None],
                              step: Callable[[], int]) -> None:
        """Calls ``notify`` once, before ``wrapped``'s first forward with gradients in a later
        step than the one it was built in (where DDP rebuilds its buckets)."""
        built_at, fired = step(), [False]

        def before_forward(_module: nn.Module, _args: Any) -> None:
            if not fired[0] and torch.is_grad_enabled() and step() > built_at:
                fired[0] = True
                notify()

        wrapped.register_forward_pre_hook(before_forward)

    def modules(self) -> list[nn.Module]:
        """The wrapped models (the originals)."""
        return [module for _, module, _ in self._cache.values()]


class ElasticModel(nn.Module):
    """The script's model as the managed loop trains it (see the module docstring).

    Args:
        module: The user's model (``None``: the loop's forward finds the model itself).
        forward: The loop's forward: runs ``module`` through the current world's DDP.
    """

    def __init__(self, module: nn.Module | None,
                 forward: Callable[..., Any]) -> None:
        super().__init__()
        # None for a sharded model: a new module every world, which the loop's forward
        # looks up (holding the first world's here would keep its shards alive).
        self.module = module
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model on the current world (DDP), or alone if the step was abandoned."""
        return self._forward(self.module, *args, **kwargs)


def to_device(batch: Any, device: torch.device) -> Any:
    """Moves the tensors of a batch (nested tuples, lists, dicts) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(b, device) for b in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
