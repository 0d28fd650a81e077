"""Training worker for the integration tests: an MLP in float64 through ``ElasticLoop``.

Every rank appends one JSON line per completed step to ``<audit-dir>/attempt<A>.rank<R>.jsonl``
with the sample ids it trained, so a test can audit exactly-once use across kills and joins.
The attempt is ``--attempt``, or under elastic-run the rendezvous round (``ELASTIC_ROUND``);
each rank first writes a ``{"resumed_from": STEP}`` line. ``--die-at STEP --die-rank R``
SIGKILLs that rank right after it finished step ``STEP``; ``--term-at STEP --term-rank R``
sends it SIGTERM instead (a drain). ``--step-time S`` sleeps at the start of every step, so
that a test killing processes from outside lands mid-step, as when a node dies mid-compute.
``--gate-file PATH`` holds step ``s`` until the file holds a number above ``s`` (or SIGTERM
comes), so that a test can keep training from running away while a node is still starting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import elastic
from checkpointing import CheckpointManager, ModelOptimizerState

DRAINED_EXIT_CODE = 143
_GATE_POLL_S = 0.02


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = torch.tanh(self.x @ torch.randn(8, 1, generator=generator, dtype=torch.float64))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def _hold(gate_file: str, step: int, released: threading.Event) -> None:
    """Waits until ``gate_file`` allows ``step``; a missing file allows every step."""
    while gate_file and not released.is_set():
        try:
            if step < int(Path(gate_file).read_text()):
                return
        except FileNotFoundError:
            return
        time.sleep(_GATE_POLL_S)


def _release_on_sigterm(released: threading.Event) -> None:
    """Chains a flag in front of the loop's SIGTERM handler: a held step goes on to drain."""
    loop_handler = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: FrameType | None) -> None:
        released.set()
        if callable(loop_handler):
            loop_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_term)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--attempt", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=3)
    parser.add_argument("--dataset-size", type=int, default=100)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--term-at", type=int, default=-1)
    parser.add_argument("--term-rank", type=int, default=0)
    parser.add_argument("--weights-out", default="")
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--commit-lag", type=int, default=None)
    parser.add_argument("--gate-file", default="")
    args = parser.parse_args()

    ctx = elastic.init()
    if args.attempt is None:
        args.attempt = ctx.round
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    ddp = DistributedDataParallel(model, process_group=ctx.process_group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    dataset = Synthetic(args.dataset_size)
    sampler = elastic.ElasticSampler(len(dataset), seed=11, shuffle=True)
    checkpoint = CheckpointManager(
        args.checkpoint_dir, process_group=ctx.checkpoint_group, round=args.attempt
    )
    audit = Path(args.audit_dir) / f"attempt{args.attempt}.rank{ctx.rank}.jsonl"
    audit.parent.mkdir(parents=True, exist_ok=True)
    with elastic.ElasticLoop(
        ctx, state={"train": ModelOptimizerState(model, optimizer), "scheduler": scheduler},
        checkpoint=checkpoint, sampler=sampler, max_steps=args.steps,
        checkpoint_interval=args.interval, global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch, max_commit_lag=args.commit_lag,
    ) as loop:
        print(f"[worker] rank={ctx.rank} world={ctx.world_size} resumed_from={loop.step}",
              flush=True)
        loader = DataLoader(dataset, batch_sampler=loop.batch_sampler(),
                            num_workers=args.workers)
        released = threading.Event()
        _release_on_sigterm(released)
        with audit.open("a") as log:
            log.write(json.dumps({"resumed_from": loop.step, "rank": ctx.rank,
                                  "world": ctx.world_size, "pid": os.getpid()}) + "\n")
            log.flush()
            for step in loop:
                _hold(args.gate_file, step, released)
                time.sleep(args.step_time)
                ids: list[int] = []
                for x, y, index in loop.micro_batches(loader, ddp):
                    loss = nn.functional.mse_loss(ddp(x), y)
                    loop.scale_loss(loss).backward()
                    ids.extend(index.tolist())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                log.write(json.dumps({"step": step, "rank": ctx.rank, "world": ctx.world_size,
                                      "ids": ids}) + "\n")
                log.flush()
                if step == args.die_at and ctx.rank == args.die_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == args.term_at and ctx.rank == args.term_rank:
                    os.kill(os.getpid(), signal.SIGTERM)
                loop.end_step()
    print(f"[worker] rank={ctx.rank} stopped at step {loop.step} drained={loop.drained}",
          flush=True)
    if loop.finished and ctx.is_leader and args.weights_out:
        torch.save(model.state_dict(), args.weights_out)
    return DRAINED_EXIT_CODE if loop.drained else 0


if __name__ == "__main__":
    sys.exit(main())
