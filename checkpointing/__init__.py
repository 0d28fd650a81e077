"""Asynchronous, atomic, sharded checkpoints on any fsspec storage.

Security note: tensor shards are read by DCP with ``torch.load(weights_only=True)``, but DCP's
own ``.metadata`` file (and non-tensor values) are unpickled without restriction. The CRC32s in
``COMMIT.json`` detect damage, not tampering: only load checkpoints from buckets whose writers
you trust.
"""

from __future__ import annotations

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
