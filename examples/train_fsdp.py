"""A sharded elastic training job: a small transformer, ``fully_shard`` per block (FSDP2).

Run it on one machine with an embedded etcd and two workers::

    elastic-run --standalone --nproc-per-node 2 examples/train_fsdp.py

or on every node of a cluster, HSDP with two replica groups while there are enough workers::

    elastic-run --min-nodes 2 --max-nodes 8 --etcd etcd-0:2379 --job-id exp-1 \\
        examples/train_fsdp.py --replicate 2

The script hands ``ElasticLoop`` the model with its initial weights, ``parallelize`` (how to
shard it on a ``DeviceMesh``), and the optimizer as a callable of the parameters. The loop
shards the model on every world: when a worker or a node is lost, the survivors re-shard the
state among themselves in place (the lost shards come from a peer's host copy, or from an
HSDP replica), and a worker that joins gets its shard from them; nobody restarts and storage
is read only when both holders of a shard are gone. See ``docs/sharded.md``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import elastic


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Token features in, one value per token out."""

    def __init__(self, features: int, width: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2: each block is one unit of gathering, then the root (HSDP on a 2-D mesh)."""
    assert isinstance(model, Transformer)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step")
    parser.add_argument("--micro-batch", type=int, default=8, help="largest per-rank batch")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--replicate", type=int, default=1,
                        help="HSDP replica groups (1: FSDP over every worker)")
    parser.add_argument("--redundancy", type=int, default=1,
                        help="1: each shard also in a peer's host memory; 0: storage only")
    job = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    parser.add_argument("--checkpoint-dir", default=f"runs/{job}-fsdp",
                        help="any fsspec URL (default runs/<job id>-fsdp)")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between saves")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    return parser.parse_args()


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(size, 16, 8, generator=generator)
    targets = torch.tanh(tokens.sum(-1, keepdim=True))
    return TensorDataset(tokens, targets)


def main() -> int:
    args = parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    ctx = elastic.init()  # nccl if CUDA else gloo
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    loop = elastic.ElasticLoop(
        ctx, model=Transformer(8, args.width, heads=4, blocks=args.blocks),
        parallelize=parallelize, replicate=args.replicate, redundancy=args.redundancy,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        data=synthetic_dataset(4096, args.seed), seed=args.seed,
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        max_steps=args.steps, checkpoint=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_every,
    )
    for x, y in loop.batches():
        loss = nn.functional.mse_loss(loop.model(x), y)
        loop.backward(loss)
        if ctx.is_leader and loop.at_step_end and loop.step % 10 == 9:
            print(f"[train_fsdp] step {loop.step + 1}/{args.steps} world={ctx.world_size} "
                  f"loss={loss.item():.4f}", flush=True)
    if ctx.is_leader and loop.finished:
        print(f"[train_fsdp] done: {loop.step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
