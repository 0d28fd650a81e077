"""elastic-run: fault-tolerant elastic training for PyTorch.

This module must stay import-light: torch imports ``membership.rendezvous`` through the
``torchrun.handlers`` entry point while ``torch.distributed.elastic`` is itself being imported,
so public names are resolved lazily (PEP 562) instead of being imported here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.batching import BatchPlan, plan_batches
    from elastic.context import ElasticContext, World
    from elastic.loop import ElasticLoop
    from elastic.sampler import ElasticSampler
    from elastic.startup import init
    from elastic.stream import ElasticShardedStream, Shard, write_jsonl_shard

__all__ = [
    "BatchPlan",
    "ElasticContext",
    "ElasticLoop",
    "ElasticSampler",
    "ElasticShardedStream",
    "Shard",
    "World",
    "init",
    "plan_batches",
    "write_jsonl_shard",
]

_LAZY_EXPORTS = {
    "ElasticSampler": "elastic.sampler",
    "BatchPlan": "elastic.batching",
    "plan_batches": "elastic.batching",
    "ElasticContext": "elastic.context",
    "World": "elastic.context",
    "init": "elastic.startup",
    "ElasticLoop": "elastic.loop",
    "ElasticShardedStream": "elastic.stream",
    "Shard": "elastic.stream",
    "write_jsonl_shard": "elastic.stream",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
