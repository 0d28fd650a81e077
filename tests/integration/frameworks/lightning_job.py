"""A Lightning training job under the elastic-run integration, for the framework tests.

A float64 MLP regressing a fixed synthetic dataset with Adam, no randomness in a step, so
that two runs on any worlds can be compared to 1e-9. Every rank appends one JSON line per
completed optimizer step to ``<audit-dir>/round<R>.rank<K>.jsonl`` (the sample ids it
trained) and one ``resumed`` line when training starts, so a test can check which
checkpoint each world resumed from and that every sample was trained exactly once. Rank 0
saves the final weights to ``--weights-out`` when the job trains to its last step.
``--gate-file PATH`` holds step ``s`` until the file holds a number above ``s`` (or this rank
is asked to drain), so that a test decides where each world stops and injects its faults.
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

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset

from elastic.integrations.lightning import ElasticLightning


class Synthetic(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = torch.tanh(self.x @ torch.randn(8, 1, generator=generator, dtype=torch.float64))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class Regressor(pl.LightningModule):
    def __init__(self, step_time: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
        self.step_time = step_time
        self.ids: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.ids.extend(ids.tolist())
        if self.step_time:
            time.sleep(self.step_time)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


class Audit(pl.Callback):
    """One line per completed optimizer step: the ids this rank trained in it."""

    def __init__(self, directory: str, model: Regressor, gate_file: str,
                 released: Callable[[], bool]) -> None:
        self.directory = Path(directory)
        self.model = model
        self.gate_file, self.released = gate_file, released
        self.last = -1
        self.file: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.hold(trainer.global_step, trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"round{os.environ.get('ELASTIC_ROUND', '0')}.rank{trainer.global_rank}.jsonl"
        self.file = (self.directory / name).open("a")
        self.last = trainer.global_step
        self._write({"resumed": trainer.global_step, "pid": os.getpid()}, trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.last:
            self.last = trainer.global_step
            self._write({"step": trainer.global_step - 1, "ids": self.model.ids}, trainer)
            self.model.ids = []

    def hold(self, step: int, trainer: pl.Trainer) -> None:
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
                self._write({"held": step}, trainer)
            time.sleep(0.02)

    def _write(self, record: dict[str, Any], trainer: pl.Trainer) -> None:
        record.update(rank=trainer.global_rank, world=trainer.world_size,
                      round=int(os.environ.get("ELASTIC_ROUND", "0")), time=time.time())
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--audit-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=10)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--dataset-size", type=int, default=64)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--weights-out", default="")
    parser.add_argument("--gate-file", default="")
    args = parser.parse_args()

    elastic = ElasticLightning(args.checkpoint_dir, global_batch_size=args.global_batch,
                               accumulate_grad_batches=args.accumulate,
                               checkpoint_every=args.every, seed=11, keep_last=1000)
    model = Regressor(args.step_time)
    loader = elastic.dataloader(Synthetic(args.dataset_size))
    trainer = pl.Trainer(**elastic.trainer_kwargs(
        max_steps=args.steps, precision="64-true", logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Audit(args.audit_dir, model, args.gate_file, lambda: elastic.drain.requested)]))
    trainer.fit(model, loader, ckpt_path=elastic.resume_path())
    if trainer.global_rank == 0 and trainer.global_step == args.steps and args.weights_out:
        torch.save(model.net.state_dict(), args.weights_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
