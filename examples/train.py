"""A small elastic training job: an MLP regressing synthetic data on CPU (gloo) or GPU (nccl).

Run it on one machine with an embedded etcd and two workers::

    elastic-run --standalone --nproc-per-node 2 examples/train.py

or on every node of a cluster (nodes may come and go while it trains)::

    elastic-run --min-nodes 2 --max-nodes 8 --etcd etcd-0:2379 --job-id exp-1 examples/train.py

It is a plain PyTorch training loop handed to ``elastic.ElasticLoop``: the loop owns the DDP
wrapper, the optimizer step, the data order and the checkpoints. The global batch is the same
on any world size, every sample of an epoch is trained exactly once across membership changes,
and when a worker or a node is lost (or joins) the survivors reconfigure in place and go on
from the step in flight, without restarting or reading a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic

DRAINED_EXIT_CODE = 143  # stopped early by SIGTERM after a final checkpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16, help="largest per-rank batch")
    parser.add_argument("--dataset-size", type=int, default=8192, help="synthetic samples")
    # One directory per job id (elastic-run and torchrun give it to every worker): a job
    # restarted under the same id resumes, and another job, the demo's included, never does.
    job = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    parser.add_argument("--checkpoint-dir", default=f"runs/{job}",
                        help="any fsspec URL (default runs/<job id>)")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step, to make the demo watchable")
    return parser.parse_args()


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 32, generator=generator)
    true_weights = torch.randn(32, 1, generator=generator)
    targets = torch.tanh(inputs @ true_weights) + 0.05 * torch.randn(size, 1, generator=generator)
    return TensorDataset(inputs, targets)


def main() -> int:
    args = parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    ctx = elastic.init()  # the world from elastic-run (or torchrun); nccl if CUDA else gloo
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loop = elastic.ElasticLoop(
        ctx, model=model, optimizer=optimizer,
        data=synthetic_dataset(args.dataset_size, args.seed), seed=args.seed,
        global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
        max_steps=args.steps, checkpoint=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_every,
    )
    for x, y in loop.batches():
        loss = nn.functional.mse_loss(loop.model(x), y)
        loop.backward(loss)
        if args.step_time:
            time.sleep(args.step_time / max(1, loop.grad_accum_steps))
        if ctx.is_leader and loop.at_step_end and loop.step % 10 == 9:
            print(f"[train] step {loop.step + 1}/{args.steps} world={ctx.world_size} "
                  f"loss={loss.item():.4f}", flush=True)
    if loop.drained:
        print(f"[train] rank {ctx.rank} drained at step {loop.step}", flush=True)
        return DRAINED_EXIT_CODE
    if ctx.is_leader and loop.finished:
        print(f"[train] done: {loop.step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
