"""Asynchronous, atomic, sharded checkpoints on any fsspec storage.

Security note: tensor shards are read by DCP with ``torch.load(weights_only=True)``, but DCP's
own ``.metadata`` file (and non-tensor values) are unpickled without restriction. The CRC32s in
``COMMIT.json`` detect damage, not tampering: only load checkpoints from buckets whose writers
you trust.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointing.manager import AsyncMode, CheckpointInfo, CheckpointManager, SaveHandle
    from checkpointing.retention import plan_retention
    from checkpointing.state import ModelOptimizerState

__all__ = [
    "AsyncMode",
    "CheckpointInfo",
    "CheckpointManager",
    "ModelOptimizerState",
    "SaveHandle",
    "plan_retention",
]

#: Where each exported name lives. They are imported on first use: the manager pulls in DCP
#: and DTensor (about 1 CPU-second per process), and every node agent imports this package
#: for its memory store (:mod:`checkpointing.memory_store`) without needing either.
_EXPORTS = {"AsyncMode": "manager", "CheckpointInfo": "manager", "CheckpointManager": "manager",
            "SaveHandle": "manager", "plan_retention": "retention",
            "ModelOptimizerState": "state"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'checkpointing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"checkpointing.{module}"), name)
    globals()[name] = value
    return value
