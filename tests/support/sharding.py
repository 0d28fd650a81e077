"""Sharding a small test model with FSDP2: the ``parallelize`` the sharded tests pass."""

from __future__ import annotations

from typing import Any

from torch import nn


def shard_linear_layers(model: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` on each ``nn.Linear`` of a ``Sequential`` and on the whole model (a
    1-D mesh: FSDP; a 2-D ``("replicate", "shard")`` mesh: HSDP)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
