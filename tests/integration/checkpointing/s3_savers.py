"""The savers that ``test_s3_crash_consistency.py`` kills, in a module of their own that
imports only what a save needs: the fork server preloads it, so a saver starts in a fork
instead of importing pytest and the test module first."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from checkpointing import CheckpointManager

NUMEL = 64 * 1024  # 256 KiB of float32 per tensor
TENSORS = 4  # with the 4 I/O threads of remote storage: 4 shard objects per rank


def state(step: int, ranks: int = 0) -> dict[str, torch.Tensor]:
    """Several tensors, so that a mix of two steps would show; in a save of ``ranks`` ranks,
    one more per rank, so that each rank writes shards of its own besides its share of the
    replicated ones."""
    tensors = {f"t{i}": torch.full((NUMEL,), float(step)) for i in range(TENSORS)}
    for rank in range(ranks):
        tensors[f"rank{rank}"] = torch.full((NUMEL,), float(step * 10 + rank))
    return tensors


def save_alone(url: str, options: dict[str, Any], step: int, saving: Any, took: Any) -> None:
    """Saves ``step`` as the one rank of its job; sets ``saving`` when the save starts and
    ``took`` to how long it took, retention pass included."""
    with CheckpointManager(url, storage_options=options, keep_last=2) as mgr:
        saving.set()  # the manager checked the root: the save starts now
        started = time.monotonic()
        mgr.save(step, state(step)).committed.result(60)
        mgr.wait()
        took.value = time.monotonic() - started


def save_as_rank(url: str, options: dict[str, Any], step: int, rank: int, port: int,
                 saving: Any) -> None:
    """Saves ``step`` as ``rank`` of 2 (the store at ``port``); rank 0 sets ``saving`` when
    both start the save."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    with CheckpointManager(url, storage_options=options, keep_last=2) as mgr:
        dist.barrier()
        if rank == 0:
            saving.set()
        mine = {k: v for k, v in state(step, 2).items() if k != f"rank{1 - rank}"}
        mgr.save(step, mine).committed.result(60)
    dist.destroy_process_group()
