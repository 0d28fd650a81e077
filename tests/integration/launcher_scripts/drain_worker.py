"""An ``ElasticLoop`` worker for the preemption tests: tiny DDP model, checkpoints, SIGTERM drain.

Every rank appends one JSON line per completed step to ``--out`` (``rank, world, round, step,
agent``) and, when it stops, one ``exit`` line (``drained``, ``step``); global rank 0 also
records ``step`` events (with the step's compute time) in the job event log when elastic-run
has one (``ELASTIC_EVENTS_DIR``). A drained worker exits 143, like ``examples/train.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elastic
from checkpointing import CheckpointManager, ModelOptimizerState
from elastic.eventlog import EventLog

DRAINED_EXIT_CODE = 143


def _append(path: str, record: dict[str, object]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--step-time", type=float, default=0.1)
    args = parser.parse_args()

    ctx = elastic.init()
    agent = os.environ.get("ELASTIC_AGENT_PID", "")
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    ddp = DistributedDataParallel(model, process_group=ctx.process_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    checkpoint = CheckpointManager(args.checkpoint_dir, process_group=ctx.checkpoint_group,
                                   round=ctx.round, keep_last=1000)
    events = EventLog.from_env() if ctx.is_leader else EventLog(None, job="", source="worker")
    with elastic.ElasticLoop(
        ctx, state={"train": ModelOptimizerState(model, optimizer)}, checkpoint=checkpoint,
        sampler=None, max_steps=args.steps, checkpoint_interval=args.interval,
        global_batch_size=6,
    ) as loop:
        for step in loop:
            started = time.monotonic()
            x = torch.full((2, 4), float(step), dtype=torch.float64)
            ddp(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            time.sleep(args.step_time)
            duration = time.monotonic() - started
            _append(args.out, {"rank": ctx.rank, "world": ctx.world_size, "round": ctx.round,
                               "step": step, "agent": agent})
            events.record("step", round=ctx.round, step=step, duration_s=round(duration, 4),
                          world=ctx.world_size)
            loop.end_step()
    _append(args.out, {"exit": True, "rank": ctx.rank, "round": ctx.round, "agent": agent,
                       "drained": loop.drained, "step": loop.step})
    return DRAINED_EXIT_CODE if loop.drained else 0


if __name__ == "__main__":
    sys.exit(main())
