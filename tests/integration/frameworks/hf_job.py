"""A Hugging Face ``Trainer`` job under the elastic-run integration, for the framework tests.

The same float64 regression as ``lightning_job.py`` (Adam, a step-wise LR schedule, no
randomness in a step), through ``ElasticTrainer``. Every rank appends one JSON line per
completed optimizer step to ``<audit-dir>/round<R>.rank<K>.jsonl`` (the sample ids it
trained) and one ``resumed`` line when training starts. Rank 0 saves the final weights to
``--weights-out`` when the job trains to its last step. ``--gate-file PATH`` holds step ``s``
until the file holds a number above ``s`` (or this rank is asked to drain), so that a test
decides where each world stops and injects its faults.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments

from elastic.integrations.hf import ElasticTrainer


class Synthetic(Dataset[dict[str, Any]]):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = torch.tanh(self.x @ torch.randn(8, 1, generator=generator, dtype=torch.float64))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self.x[index], "labels": self.y[index], "idx": index}


class Regressor(nn.Module):
    def __init__(self, step_time: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
        self.step_time = step_time
        self.ids: list[int] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor) -> Any:
        if self.training:
            self.ids.extend(idx.tolist())
            if self.step_time:
                time.sleep(self.step_time)
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Audit(TrainerCallback):  # type: ignore[misc]
    """One line per completed optimizer step: the ids this rank trained in it."""

    def __init__(self, directory: str, model: Regressor, gate_file: str) -> None:
        self.directory = Path(directory)
        self.model = model
        self.gate_file = gate_file
        self.released: Callable[[], bool] = lambda: False
        self.file: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.hold(state.global_step, args)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"round{os.environ.get('ELASTIC_ROUND', '0')}.rank{args.process_index}.jsonl"
        self.file = (self.directory / name).open("a")
        self._write({"resumed": state.global_step, "pid": os.getpid()}, args)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._write({"step": state.global_step - 1, "ids": self.model.ids}, args)
        self.model.ids = []

    def hold(self, step: int, args: Any) -> None:
        """Waits until the gate file allows ``step`` (a missing file allows every step),
        saying so once in the audit log, or until this rank is asked to drain."""
        said = False
        while self.gate_file and not self.released():
            try:
                if step < int(Path(self.gate_file).read_text()):
                    return
            except (FileNotFoundError, ValueError):
                return
            if not said:
                said = True
                self._write({"held": step}, args)
            time.sleep(0.02)

    def _write(self, record: dict[str, Any], args: Any) -> None:
        record.update(rank=args.process_index, world=args.world_size,
                      round=int(os.environ.get("ELASTIC_ROUND", "0")), time=time.time())
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--dataset-size", type=int, default=64)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--weights-out", default="")
    parser.add_argument("--gate-file", default="")
    cli = parser.parse_args()

    model = Regressor(cli.step_time)
    args = TrainingArguments(
        output_dir=cli.checkpoint_dir, max_steps=cli.steps, save_steps=cli.every,
        learning_rate=1e-2, lr_scheduler_type="constant_with_warmup", warmup_steps=8,
        weight_decay=0.0, seed=11,
        per_device_train_batch_size=cli.micro_batch, use_cpu=True, report_to="none",
        disable_tqdm=True, logging_steps=1000,
        dataloader_pin_memory=False)
    audit = Audit(cli.audit_dir, model, cli.gate_file)
    trainer = ElasticTrainer(model=model, args=args, train_dataset=Synthetic(cli.dataset_size),
                             global_batch_size=cli.global_batch, callbacks=[audit])
    audit.released = lambda: trainer.elastic.drain.requested
    trainer.train()
    if args.process_index == 0 and trainer.state.global_step == cli.steps and cli.weights_out:
        torch.save(model.net.state_dict(), cli.weights_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
