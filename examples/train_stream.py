"""Elastic training from a sharded stream: JSON-lines shards, exactly once, on any world size.

Run it on one machine with an embedded etcd and two workers::

    elastic-run --standalone --nproc-per-node 2 examples/train_stream.py

or on every node of a cluster (nodes may come and go while it trains)::

    elastic-run --min-nodes 2 --max-nodes 8 --etcd etcd-0:2379 --job-id stream-1 \\
        examples/train_stream.py --data-dir /shared/stream-data

It first writes its own small corpus (``--shards`` JSON-lines shards of synthetic regression
samples, each with its offset index; every process writes the same bytes, atomically, and
skips shards that exist), then trains on it through ``elastic.ElasticShardedStream``: one
seeded global order per epoch, shuffled across shards and within a window of
``--buffer-size`` samples, read by ``--loader-workers`` DataLoader workers per rank. Each rank
reads only its part, each shard is opened at most once per epoch by each reader, and when the
world changes (or the job restarts from a checkpoint) training resumes at the next sample of
the global order, so every sample of an epoch is trained exactly once. The shards may live on
any fsspec URL (``--data-dir s3://bucket/prefix`` with s3fs installed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from torch import nn

import elastic
from elastic.stream import ElasticShardedStream, Shard, write_jsonl_shard

DRAINED_EXIT_CODE = 143  # stopped early by SIGTERM after a final checkpoint
FEATURES = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16, help="largest per-rank batch")
    parser.add_argument("--data-dir", default="runs/stream-data", help="where the shards go")
    parser.add_argument("--shards", type=int, default=16, help="shards to write")
    parser.add_argument("--samples-per-shard", type=int, default=500)
    parser.add_argument("--buffer-size", type=int, default=2048,
                        help="samples per shuffle window (a few shards' worth)")
    parser.add_argument("--loader-workers", type=int, default=2,
                        help="DataLoader worker processes per rank")
    parser.add_argument("--checkpoint-dir", default="runs/stream-demo", help="any fsspec URL")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step, to make the demo watchable")
    return parser.parse_args(argv)


def write_corpus(data_dir: str, shards: int, per_shard: int, seed: int) -> list[Shard]:
    """The synthetic corpus: ``y = tanh(x . w) + noise``, the same bytes on every process."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(data_dir)
    fs.makedirs(root, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    true_weights = torch.randn(FEATURES, 1, generator=generator, dtype=torch.float64)
    out = []
    for i in range(shards):
        url = f"{data_dir.rstrip('/')}/train-{i:05d}.jsonl"
        if not fs.exists(f"{root}/train-{i:05d}.jsonl"):
            shard_gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
            x = torch.randn(per_shard, FEATURES, generator=shard_gen, dtype=torch.float64)
            y = torch.tanh(x @ true_weights) + 0.05 * torch.randn(
                per_shard, 1, generator=shard_gen, dtype=torch.float64)
            samples = [{"x": row.tolist(), "y": float(t)} for row, t in zip(x, y[:, 0],
                                                                           strict=True)]
            # Written under a name of this process, then renamed: a reader never sees half
            # a shard, and processes writing the same shard at once write the same bytes.
            tmp = f"{url}.tmp{os.getpid()}"
            write_jsonl_shard(tmp, samples)
            fs.mv(f"{root}/train-{i:05d}.jsonl.tmp{os.getpid()}.idx",
                  f"{root}/train-{i:05d}.jsonl.idx")
            fs.mv(f"{root}/train-{i:05d}.jsonl.tmp{os.getpid()}", f"{root}/train-{i:05d}.jsonl")
        out.append(Shard(url, per_shard))
    return out


class ToTensors:
    """A JSON sample to ``(x, y)`` tensors (a class, so that it pickles for any worker)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(sample["x"], dtype=self.dtype),
                torch.tensor([sample["y"]], dtype=self.dtype))


def build(args: argparse.Namespace,
          ctx: elastic.ElasticContext | None) -> tuple[nn.Module, elastic.ElasticLoop]:
    """The model and the loop that trains it on the stream (``ctx=None``: one process)."""
    dtype = getattr(torch, args.dtype)
    device = ctx.device if ctx is not None else torch.device("cpu")
    shards = write_corpus(args.data_dir, args.shards, args.samples_per_shard, args.seed)
    stream = ElasticShardedStream(shards, seed=args.seed, buffer_size=args.buffer_size,
                                  transform=ToTensors(dtype))
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(FEATURES, 64, dtype=dtype), nn.Tanh(),
                          nn.Linear(64, 1, dtype=dtype)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loop = elastic.ElasticLoop(
        ctx, model=model, optimizer=optimizer, data=stream,
        loader_options={"num_workers": args.loader_workers},
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        max_steps=args.steps, checkpoint=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_every,
    )
    return model, loop


def train(args: argparse.Namespace, loop: elastic.ElasticLoop, leader: bool) -> None:
    """The training loop: every micro-batch of every step still to run."""
    for x, y in loop.batches():
        loss = nn.functional.mse_loss(loop.model(x), y)
        loop.backward(loss)
        if args.step_time:
            time.sleep(args.step_time / max(1, loop.grad_accum_steps))
        if leader and loop.at_step_end and loop.step % 10 == 9:
            cursor = loop.sampler
            assert cursor is not None
            print(f"[train_stream] step {loop.step + 1}/{args.steps} world="
                  f"{loop.plan.world_size} epoch={cursor.epoch} sample={cursor.consumed}/"
                  f"{cursor.dataset_size} loss={loss.item():.4f}", flush=True)


def main() -> int:
    args = parse_args()
    ctx = elastic.init()  # the world from elastic-run (or torchrun); nccl if CUDA else gloo
    _model, loop = build(args, ctx)
    train(args, loop, ctx.is_leader)
    if loop.drained:
        print(f"[train_stream] rank {ctx.rank} drained at step {loop.step}", flush=True)
        return DRAINED_EXIT_CODE
    if ctx.is_leader and loop.finished:
        print(f"[train_stream] done: {loop.step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
