"""A small elastic training job: an MLP regressing synthetic data on CPU (gloo) or GPU (nccl).

Run it on one machine with an embedded etcd and two workers::

    elastic-run --standalone --nproc-per-node 2 examples/train.py

or on every node of a cluster::

    elastic-run --min-nodes 2 --max-nodes 8 --etcd etcd-0:2379 --job-id exp-1 examples/train.py

What makes it elastic, in plain PyTorch:

* The global batch is fixed (``--global-batch``). Each step takes the next ``global_batch``
  positions of a seeded permutation of the data set and splits them over however many ranks
  there are now, so no sample is lost or repeated and the optimisation does not depend on the
  world size (each rank's loss is the *sum* over its share scaled by ``world / global_batch``,
  so DDP's mean across ranks equals the mean over the global batch).
* Rank 0 writes ``{model, optimizer, step}`` every ``--checkpoint-every`` steps, atomically
  (temporary file, fsync, rename). After a membership change the agent restarts the workers,
  which resume from the last checkpoint at whatever world size the new round has.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--dataset-size", type=int, default=8192, help="synthetic samples")
    parser.add_argument("--checkpoint-dir", default="runs/demo", help="where rank 0 saves")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step, to make the demo watchable")
    return parser.parse_args()


def synthetic_dataset(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 32, generator=generator)
    true_weights = torch.randn(32, 1, generator=generator)
    targets = torch.tanh(inputs @ true_weights) + 0.05 * torch.randn(size, 1, generator=generator)
    return inputs, targets


def global_batch_indices(step: int, global_batch: int, size: int, seed: int) -> torch.Tensor:
    """Positions ``[step * global_batch, (step + 1) * global_batch)`` of the epoch permutations."""
    first = step * global_batch
    epoch, offset = divmod(first, size)
    chunks = []
    remaining = global_batch
    while remaining > 0:
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        take = order[offset : offset + remaining]
        chunks.append(take)
        remaining -= len(take)
        epoch, offset = epoch + 1, 0
    return torch.cat(chunks)


def save_checkpoint(path: Path, model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # the checkpoint counts only once it is complete under its final name


def main() -> None:
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" \
        else torch.device("cpu")

    torch.set_default_dtype(getattr(torch, args.dtype))
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=args.lr)
    ckpt = Path(args.checkpoint_dir) / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optim.load_state_dict(saved["optim"])
        step = int(saved["step"])
    ddp = DistributedDataParallel(model)
    inputs, targets = synthetic_dataset(args.dataset_size, args.seed)
    if rank == 0:
        print(f"[train] round={os.environ.get('ELASTIC_ROUND', '?')} world={world} "
              f"resuming at step {step}/{args.steps}", flush=True)

    while step < args.steps:
        batch = global_batch_indices(step, args.global_batch, args.dataset_size, args.seed)
        mine = batch[rank::world]
        x, y = inputs[mine].to(device), targets[mine].to(device)
        loss_sum = nn.functional.mse_loss(ddp(x), y, reduction="sum")
        (loss_sum * world / args.global_batch).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        step += 1
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"[train] step {step}/{args.steps} world={world} "
                  f"loss={loss_sum.item() / max(len(mine), 1):.4f}", flush=True)
        if rank == 0 and (step % args.checkpoint_every == 0 or step == args.steps):
            save_checkpoint(ckpt, model, optim, step)
    dist.barrier()
    if rank == 0:
        print(f"[train] done: {step} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
