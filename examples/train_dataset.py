"""Elastic training with a real map-style ``Dataset`` read by ``DataLoader`` worker processes.

The dataset lives in files (one ``.pt`` shard per 256 samples, written on first use under
``--data-dir``); each ``__getitem__`` reads from its shard, as an image or text dataset would.
``ElasticSampler`` runs in the main process and hands indices to the workers, so the
exactly-once accounting does not depend on ``num_workers``::

    elastic-run --standalone --nproc-per-node 2 examples/train_dataset.py --num-workers 2
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import elastic

SHARD = 256


class ShardedFileDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples stored in ``shard-*.pt`` files; workers load shards lazily and cache them."""

    def __init__(self, root: Path, size: int) -> None:
        self.root, self.size = root, size

    @staticmethod
    def materialise(root: Path, size: int, seed: int) -> None:
        """Writes the missing shards (each atomically: a rename of a file of this process)."""
        root.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(seed)
        weights = torch.randn(16, 4, generator=generator)
        for first in range(0, size, SHARD):
            path = root / f"shard-{first // SHARD:05d}.pt"
            x = torch.randn(min(SHARD, size - first), 16, generator=generator)
            if not path.exists():
                tmp = path.with_suffix(f".tmp{os.getpid()}")  # several workers may race
                torch.save({"x": x, "y": (x @ weights).argmax(1)}, tmp)
                tmp.replace(path)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - per worker process, bounded
    def _shard(self, number: int) -> dict[str, torch.Tensor]:
        shard: dict[str, torch.Tensor] = torch.load(
            self.root / f"shard-{number:05d}.pt", weights_only=True
        )
        return shard

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self._shard(index // SHARD)
        return shard["x"][index % SHARD], shard["y"][index % SHARD]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--dataset-size", type=int, default=4096)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--data-dir", default="runs/dataset-data")
    parser.add_argument("--checkpoint-dir", default="runs/dataset-demo")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = elastic.init()
    # Every worker writes the shards it finds missing (atomically): no collective of our
    # own is needed, so a worker that joins a running job runs the same code.
    ShardedFileDataset.materialise(Path(args.data_dir), args.dataset_size, args.seed)
    dataset = ShardedFileDataset(Path(args.data_dir), args.dataset_size)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loop = elastic.ElasticLoop(
        ctx, model=model, optimizer=optimizer, data=dataset,
        scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps),
        sampler=elastic.ElasticSampler(len(dataset), seed=args.seed, drop_last=True),
        loader_options={"num_workers": args.num_workers,
                        "persistent_workers": args.num_workers > 0},
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        max_steps=args.steps, checkpoint=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_every,
    )
    correct = seen = 0
    for x, y in loop.batches():
        logits = loop.model(x)
        loop.backward(nn.functional.cross_entropy(logits, y))
        correct += int((logits.argmax(1) == y).sum())
        seen += len(y)
        if loop.at_step_end:
            if ctx.is_leader and loop.step % 10 == 9:
                print(f"[train_dataset] step {loop.step + 1}/{args.steps} "
                      f"world={ctx.world_size} accuracy={correct / seen:.2f}", flush=True)
            correct = seen = 0
    if ctx.is_leader and loop.finished:
        print(f"[train_dataset] done: {loop.step} steps", flush=True)
    return 143 if loop.drained else 0


if __name__ == "__main__":
    sys.exit(main())
