"""A Lightning training script under elastic-run: the plain script, five lines changed.

Run it on one machine with an embedded etcd and two workers::

    elastic-run --standalone --nproc-per-node 2 examples/train_lightning.py

or on every node of a cluster (nodes may come and go; each change restarts the workers,
which resume from the newest committed checkpoint)::

    elastic-run --min-nodes 2 --max-nodes 8 --etcd etcd-0:2379 --job-id exp-1 \\
        --preemption-watch auto examples/train_lightning.py --checkpoint-dir s3://bucket/exp-1

The lines marked ``elastic-run`` are the whole difference from the plain Lightning script
(README.md shows the diff): a global batch of 64 on any world size, every sample of an epoch
once, a final checkpoint on a preemption notice, and the job's steps in ``elastic-run
goodput`` and ``--metrics-port``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic.integrations.lightning import ElasticLightning  # elastic-run


class Regressor(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)  # a mean over the micro-batch
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 32, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(32, 1, generator=generator))
    return TensorDataset(inputs, targets)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    job = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    parser.add_argument("--checkpoint-dir", default=f"runs/{job}-lightning",
                        help="any fsspec URL, shared by every node (default runs/<job id>-...)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Regressor(args.lr)
    elastic = ElasticLightning(args.checkpoint_dir, global_batch_size=64,  # elastic-run
                               checkpoint_every=20, seed=args.seed)
    loader = elastic.dataloader(synthetic_dataset(8192, args.seed))  # elastic-run
    trainer = pl.Trainer(**elastic.trainer_kwargs(  # elastic-run
        max_steps=args.steps, logger=False, enable_progress_bar=False))
    trainer.fit(model, loader, ckpt_path=elastic.resume_path())  # elastic-run
    if trainer.is_global_zero:
        print(f"[train] done: {trainer.global_step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
