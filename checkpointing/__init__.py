"""Asynchronous, atomic, sharded checkpoints on any fsspec storage."""

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
