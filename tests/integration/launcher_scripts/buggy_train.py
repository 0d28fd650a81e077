"""A managed-loop script with a bug of its own: every rank raises at step ``--fail-at``.

Used to check that the job then ends at once with the script's error (restarting would only
repeat it). ``--error`` picks the exception type: a ``RuntimeError`` is also the type a dead
peer's collective raises, so it exercises telling the two apart by membership evidence.

``--kill-at N`` is a fault that survives reconfigurations instead: the world's last rank
SIGKILLs itself at step N, and so does the last rank of the next world (or the replacement,
which joins as the last rank), so the survivors abandon step N over and over.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import elastic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-at", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--error", choices=["RuntimeError", "ValueError"],
                        default="RuntimeError")
    args = parser.parse_args()
    ctx = elastic.init()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loop = elastic.ElasticLoop(ctx, model=model,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data=data, global_batch_size=16, max_steps=1000)
    for x, y in loop.batches():
        if loop.step == args.kill_at and ctx.rank == ctx.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.kill_at < 0 and loop.step == args.fail_at:
            print(f"[buggy_train] rank {ctx.rank} raises at {time.time():.3f}", flush=True)
            raise {"RuntimeError": RuntimeError, "ValueError": ValueError}[args.error](
                f"the labels of step {loop.step} are out of range (a bug in the script)")
        loop.backward(nn.functional.mse_loss(loop.model(x), y))
        time.sleep(0.02)


if __name__ == "__main__":
    main()
