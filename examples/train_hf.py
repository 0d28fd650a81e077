"""A Hugging Face ``Trainer`` script under elastic-run: the plain script, two lines changed.

Run it on one machine with an embedded etcd and two workers::

    elastic-run --standalone --nproc-per-node 2 examples/train_hf.py

or on every node of a cluster (nodes may come and go; each change restarts the workers,
which resume from the newest committed checkpoint)::

    elastic-run --min-nodes 2 --max-nodes 8 --etcd etcd-0:2379 --job-id exp-1 \\
        --preemption-watch auto examples/train_hf.py --output-dir /shared/exp-1

The lines marked ``elastic-run`` are the whole difference from the plain script (README.md
shows the diff): a global batch of 64 on any world size, every sample of an epoch once, a
final checkpoint on a preemption notice, and the job's steps in ``elastic-run goodput`` and
``--metrics-port``. Any ``PreTrainedModel`` works the same way; this one is tiny.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import TrainingArguments

from elastic.integrations.hf import ElasticTrainer  # elastic-run


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}  # a mean


class Synthetic(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 32, generator=generator)
        self.y = torch.tanh(self.x @ torch.randn(32, 1, generator=generator))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train")
    job = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    parser.add_argument("--output-dir", default=f"runs/{job}-hf",
                        help="checkpoints, on storage every node shares (default runs/<job id>-hf)")
    parser.add_argument("--seed", type=int, default=1234)
    cli = parser.parse_args()

    torch.manual_seed(cli.seed)  # the same initial weights on every rank
    args = TrainingArguments(
        output_dir=cli.output_dir, max_steps=cli.steps, save_steps=20, save_total_limit=3,
        per_device_train_batch_size=32, learning_rate=1e-2, seed=cli.seed,
        report_to="none", disable_tqdm=True, logging_steps=50,
        use_cpu=not torch.cuda.is_available())  # else Trainer runs CPU workers as separate jobs
    trainer = ElasticTrainer(model=Regressor(), args=args,  # elastic-run
                             train_dataset=Synthetic(8192, cli.seed),
                             global_batch_size=64)  # elastic-run
    trainer.train()
    if args.process_index == 0:
        print(f"[train] done: {trainer.state.global_step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
