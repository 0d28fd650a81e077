"""A plain torchrun DDP script that knows nothing of elastic-run.

It is the kind of script most teams already have: ``torch.distributed`` set up from the
launcher's environment, ``DistributedDataParallel``, a ``DistributedSampler``, and its own
``torch.save`` checkpoints in a directory, from which it resumes when it is started again.
It runs unchanged under both launchers::

    torchrun --nproc-per-node 2 examples/train_torchrun.py --checkpoint-dir runs/plain
    elastic-run --standalone --nproc-per-node 2 examples/train_torchrun.py \
        --checkpoint-dir runs/plain

Under elastic-run it runs in restart mode: on every membership change the workers are
restarted and the script resumes from its newest checkpoint, as under torchrun.

What keeps the result independent of the world size: the global batch is fixed
(``--global-batch``, split evenly across the ranks), a ``DistributedSampler`` over a dataset
whose size every world size divides gives global batch ``s`` the same samples whatever the
world size (rank ``r`` takes positions ``r, r + W, ...`` of one seeded permutation), and a
resumed run skips the batches of the epoch it already trained. In float64 a job restarted
with other world sizes ends with the weights of an undisturbed one, up to rounding.

Checkpoints are atomic: rank 0 writes ``step-NNNNNNNN.pt.tmp``, flushes it to disk, then
renames it; a file named ``step-*.pt`` is therefore always complete.

``--timing-log DIR`` appends one JSON line per milestone to ``DIR/rank{R}.{pid}.jsonl``
(script start, imports done, process group ready, model and optimizer built, checkpoint
loaded, each step), which the
restart-path benchmark reads.
"""

from __future__ import annotations

import time

SCRIPT_STARTED = time.time()  # before any other import: the imports are timed from here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

IMPORTED = time.time()
CHECKPOINT_NAME = re.compile(r"^step-(\d{8})\.pt$")
KEEP_CHECKPOINTS = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True, help="a local directory")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    parser.add_argument("--global-batch", type=int, default=12, help="samples per step")
    parser.add_argument("--dataset-size", type=int, default=240, help="synthetic samples")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between saves")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="extra seconds per step (a stand-in for a bigger model)")
    parser.add_argument("--weights-out", default=None, help="rank 0 saves the final weights")
    parser.add_argument("--timing-log", default=None, help="a directory for timing records")
    return parser.parse_args()


class Timing:
    """Milestones of this process, one JSON line each (nothing when no directory is given)."""

    def __init__(self, directory: str | None, rank: int) -> None:
        self.path = (Path(directory) / f"rank{rank}.{os.getpid()}.jsonl"
                     if directory else None)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, at: float, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"event": event, "time": at, "pid": os.getpid(), **fields}
        with open(self.path, "a") as log:
            log.write(json.dumps(record) + "\n")


def process_started_at() -> float:
    """Wall-clock start of this process (from ``/proc``; this script's start elsewhere)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
        # Both on the clock since boot (10 ms steps); /proc/stat's btime is whole seconds.
        return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return SCRIPT_STARTED


def synthetic_dataset(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 32, generator=generator)
    true_weights = torch.randn(32, 1, generator=generator)
    targets = torch.tanh(inputs @ true_weights) + 0.05 * torch.randn(size, 1, generator=generator)
    return TensorDataset(inputs, targets)


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(p for p in directory.glob("step-*.pt") if CHECKPOINT_NAME.match(p.name))
    return found[-1] if found else None


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> None:
    """Write-then-rename: a crash leaves a ``.tmp`` file, never a torn ``step-*.pt``."""
    final = directory / f"step-{step:08d}.pt"
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as out:
        torch.save(state, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, final)
    for old in sorted(directory.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)


def main() -> int:
    args = parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    timing = Timing(args.timing_log, rank)
    timing.write("started", SCRIPT_STARTED, process_started=process_started_at())
    timing.write("imported", IMPORTED)
    timing.write("process_group", time.time(), world=world)
    if args.dataset_size % args.global_batch or args.global_batch % world:
        sys.stderr.write(
            f"--global-batch {args.global_batch} must divide --dataset-size "
            f"{args.dataset_size} and be divisible by the world size {world}; pick sizes "
            "that every world size you run with divides.\n")
        return 2
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    timing.write("built", time.time())
    directory = Path(args.checkpoint_dir)
    directory.mkdir(parents=True, exist_ok=True)
    step = 0
    latest = latest_checkpoint(directory)
    if latest is not None:
        state = torch.load(latest, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    timing.write("loaded", time.time(), step=step)

    dataset = synthetic_dataset(args.dataset_size, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler)
    steps_per_epoch = args.dataset_size // args.global_batch
    while step < args.steps:
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch)
        for index, (x, y) in enumerate(loader):
            if index < done_in_epoch:
                continue  # trained before the restart
            loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if args.step_time:
                time.sleep(args.step_time)
            timing.write("step", time.time(), step=step, world=world)
            if rank == 0 and step % args.checkpoint_every == 0:
                save_checkpoint(directory, step, {"model": model.state_dict(),
                                                  "optimizer": optimizer.state_dict(),
                                                  "step": step})
            if step >= args.steps:
                break
    if rank == 0 and args.weights_out:
        torch.save(model.state_dict(), args.weights_out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
