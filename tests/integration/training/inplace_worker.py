"""Training worker for the in-place tests: the float64 MLP of ``worker.py``, in place.

Each process appends JSON lines to ``<audit-dir>/pid<PID>.jsonl``:

* ``{"kind": "gen", "gen", "rank", "world", "pid", "step", "storage_loads", "received",
  "source"}`` whenever it starts training in a new world (after the heal);
* ``{"kind": "batch", "gen", "step", "rank", "ids"}`` for each micro-batch, *before* its
  backward pass, so that a step some rank completed has every rank's ids logged;
* ``{"kind": "done", "gen", "step", "rank", "world", "t"}`` after ``optimizer.step()``;
* ``{"kind": "setup", "pid", "phase": "began"|"ended", "t"}`` around ``--setup-delay``.

``--setup-delay S`` sleeps between ``elastic.init()`` and the loop (a slow model build).
``--device cuda`` keeps the model, its optimizer state and the batches on the GPU (the
collectives stay on gloo, which moves CUDA tensors: several ranks can share one GPU); the
default, ``cpu``, is the CPU worker the CPU tests run. The ``gen`` record also says where
the weights are (``device``).
``--step-time S`` sleeps at the start of every step (kills from outside land mid-step).
``--pause-rank R --pause-at S --gil-pause G --slow-step L``: rank R, at step S of its first
world, holds the GIL for G seconds (a garbage-collection pause: its heartbeat thread cannot
run) and then makes that step L seconds long (a step ten times the median).
``--gate-file PATH`` holds step ``s`` until the file holds a number above ``s``, or until a
worker waits to be admitted (it is admitted at the end of the released step).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import elastic
from checkpointing import CheckpointManager, ModelOptimizerState
from tests.integration.training.worker import Synthetic
from tests.support.hang import maybe_hang

_GATE_POLL_S = 0.02


def _hold(gate_file: str, step: int, release: Callable[[], bool]) -> None:
    """Waits until the gate allows ``step``, or ``release()`` (a joiner waits to be admitted at
    the next step boundary, which a held step would never reach)."""
    while gate_file and not release():
        try:
            if step < int(Path(gate_file).read_text()):
                return
        except (FileNotFoundError, ValueError):
            return
        time.sleep(_GATE_POLL_S)


def _pause(gil_s: float, slow_s: float) -> None:
    """Holds the GIL for ``gil_s`` seconds (libc's sleep through ``ctypes.PyDLL``, which does
    not release it: no other thread of the process runs, as in a long garbage collection),
    then sleeps ``slow_s`` seconds more (a slow step)."""
    import ctypes

    if gil_s > 0:
        ctypes.PyDLL(None).usleep(int(gil_s * 1e6))
    time.sleep(slow_s)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=3)
    parser.add_argument("--dataset-size", type=int, default=100)
    parser.add_argument("--weights-out", default="")
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--gate-file", default="")
    parser.add_argument("--setup-delay", type=float, default=0.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--pause-rank", type=int, default=-1)
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--gil-pause", type=float, default=0.0)
    parser.add_argument("--slow-step", type=float, default=0.0)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # debugging a hang: kill -USR1
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO").upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s[%(process)d]: %(message)s")

    # gloo even where CUDA is present (elastic.init would pick NCCL there, and one GPU cannot
    # host two NCCL ranks): the CPU tests run the same on a GPU machine.
    ctx = elastic.init("gloo", inplace=True)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    dataset = Synthetic(args.dataset_size)
    sampler = elastic.ElasticSampler(len(dataset), seed=11, shuffle=True)
    checkpoint = CheckpointManager(args.checkpoint_dir, process_group=ctx.checkpoint_group,
                                   round=ctx.round)
    audit_path = Path(args.audit_dir) / f"pid{os.getpid()}.jsonl"
    audit_path.parent.mkdir(parents=True, exist_ok=True)
    if args.setup_delay:
        with audit_path.open("a") as audit:
            for phase in ("began", "ended"):
                if phase == "ended":
                    time.sleep(args.setup_delay)
                audit.write(json.dumps({"kind": "setup", "pid": os.getpid(), "phase": phase,
                                        "t": time.time()}) + "\n")
                audit.flush()
    paused: list[int] = []
    with audit_path.open("a") as audit, elastic.ElasticLoop(
        ctx, state={"train": ModelOptimizerState(model, optimizer), "scheduler": scheduler},
        checkpoint=checkpoint, sampler=sampler, max_steps=args.steps,
        checkpoint_interval=args.interval, global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch,
    ) as loop:

        def log(**record: object) -> None:
            audit.write(json.dumps(record) + "\n")
            audit.flush()

        logged_gen = -1
        loader: DataLoader[object] | None = None
        for step in loop:
            if ctx.generation != logged_gen:
                logged_gen = ctx.generation
                heal = ctx.inplace.last_heal if ctx.inplace is not None else None
                log(kind="gen", gen=ctx.generation, rank=ctx.rank, world=ctx.world_size,
                    pid=os.getpid(), step=step, storage_loads=loop.storage_loads,
                    received=bool(heal and heal.received),
                    source=heal.source if heal else -1,
                    device=str(next(model.parameters()).device))
            with loop.step_guard():
                _hold(args.gate_file, step, lambda: ctx.inplace is not None
                      and ctx.inplace.change_pending())
                time.sleep(args.step_time)
                if step == args.pause_at and ctx.rank == args.pause_rank and not paused:
                    paused.append(step)
                    _pause(args.gil_pause, args.slow_step)
                maybe_hang()  # a test may hold this rank here (ELASTIC_TEST_HANG_FILE)
                if loader is None:  # one loader: it follows every world (any size)
                    loader = DataLoader(dataset, batch_sampler=loop.batch_sampler())
                ddp = loop.data_parallel(model)
                for x, y, index in loop.micro_batches(loader, ddp):
                    log(kind="batch", gen=ctx.generation, step=step, rank=ctx.rank,
                        ids=index.tolist())
                    x, y = x.to(device), y.to(device)
                    loss = nn.functional.mse_loss(ddp(x), y)
                    loop.scale_loss(loss).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                log(kind="done", gen=ctx.generation, step=step, rank=ctx.rank,
                    world=ctx.world_size, t=time.time())
                loop.end_step()
        print(f"[inplace-worker] pid={os.getpid()} rank={ctx.rank} stopped at step "
              f"{loop.step}", flush=True)
        if loop.finished and ctx.is_leader and args.weights_out:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.weights_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
