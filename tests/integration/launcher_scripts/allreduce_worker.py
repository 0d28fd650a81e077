"""A tiny plain-torch elastic worker for the launcher tests (no elastic.* imports).

Every step it all-reduces a tensor over gloo, appends ``rank,world,round,step,pid`` to ``--out``
and (rank 0) writes the step to ``--ckpt`` atomically, so a restarted round resumes after the
last completed step. ``--stop-file`` ends the run cleanly on every rank. Optional faults:
``--crash-at-step`` (rank 0 of the first round only, via a marker file) and
``--linger-rank/--linger-s`` (one rank stays alive after the last step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def _read_step(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0


def _write_step(path: str, step: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--linger-rank", type=int, default=-1)
    p.add_argument("--linger-s", type=float, default=0.0)
    p.add_argument("--stop-file", default=None, help="all ranks stop once this file exists")
    a = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    rnd = os.environ.get("ELASTIC_ROUND", "?")
    step = _read_step(a.ckpt)
    while step < a.steps:
        stop = 1.0 if a.stop_file and os.path.exists(a.stop_file) else 0.0
        t = torch.tensor([1.0, stop])
        dist.all_reduce(t)
        if int(t[0].item()) != world:
            raise RuntimeError(f"all_reduce gave {t[0].item()} for world {world}")
        if t[1].item() > 0:
            break
        step += 1
        with open(a.out, "a") as f:
            f.write(f"{rank},{world},{rnd},{step},{os.getpid()}\n")
        if rank == 0:
            _write_step(a.ckpt, step)
        marker = a.ckpt + ".crashed"
        if step == a.crash_at_step and rank == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(17)
        time.sleep(a.step_time)
    dist.barrier()
    dist.destroy_process_group()
    if rank == a.linger_rank:
        time.sleep(a.linger_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
