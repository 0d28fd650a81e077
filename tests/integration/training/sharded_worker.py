"""Training worker for the sharded in-place tests: a small float64 transformer, ``fully_shard``
per block, through the managed ``ElasticLoop(parallelize=...)``.

The per-sample audit (``ELASTIC_SAMPLE_AUDIT``, set by the test) writes the ``gen``,
``batch`` and ``done`` records that :mod:`tests.integration.training.inplace_audit` reads.
The final weights are the final checkpoint's (DCP; the test gathers them into full tensors).

``--fail-reads`` checkpoints to ``failread://``: every read of the checkpoint directory fails
once a checkpoint is committed (:mod:`tests.support.failing_reads`), so a job that finishes
recovered from every fault without storage.
``--replicate R`` trains HSDP (``R`` replica groups while the world allows them).
``--explicit`` writes the steps itself (``for step in loop``, ``loop.step_guard()``,
``loop.micro_batches``, ``loop.optimizer.step()``) instead of ``loop.batches()``, and its own
audit records (the managed loop's format, through ``elastic.loop.audit.SampleAudit``).
``--step-time S`` sleeps at the start of every step (kills from outside land mid-step).
``--gate-file PATH`` holds step ``s`` until the file holds a number above ``s``, or until a
newer world is pending (a joiner is admitted at the end of the released step).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import elastic

_GATE_POLL_S = 0.02
SEQUENCE, FEATURES, WIDTH, HEADS, BLOCKS = 4, 4, 8, 2, 4


class Block(nn.Module):
    """A pre-norm transformer block: self-attention and an MLP, both residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Embedding, ``BLOCKS`` transformer blocks, a head: sequences to one value per token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    """FSDP2 per block, then the root (HSDP when the mesh is 2-D)."""
    from torch.distributed.fsdp import fully_shard

    assert isinstance(model, TinyTransformer)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: a random sequence (seeded by ``i``) and a smooth target of it."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(SEQUENCE, FEATURES, generator=g, dtype=torch.float64)
        return x, torch.tanh(x.sum(-1, keepdim=True)) + 0.1 * x[:, :1]


def _hold(gate_file: str, step: int, release: object) -> None:
    while gate_file and not (callable(release) and release()):
        try:
            if step < int(Path(gate_file).read_text()):
                return
        except (FileNotFoundError, ValueError):
            return
        time.sleep(_GATE_POLL_S)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--fail-reads", action="store_true")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--interval", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=6)
    parser.add_argument("--dataset-size", type=int, default=100)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--gate-file", default="")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--redundancy", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=0)
    parser.add_argument("--explicit", action="store_true")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # debugging a hang: kill -USR1
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "INFO").upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s[%(process)d]: %(message)s")
    url = args.checkpoint_dir
    if args.fail_reads:
        from tests.support.failing_reads import PROTOCOL, ROOT_ENV, register

        register()
        os.environ[ROOT_ENV] = args.checkpoint_dir
        url = f"{PROTOCOL}://{args.checkpoint_dir}"

    ctx = elastic.init("gloo", inplace=True)
    torch.manual_seed(0)
    dataset = Sequences(args.dataset_size)
    common: dict[str, Any] = dict(
        model=TinyTransformer().double(),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5),
        parallelize=parallelize, replicate=args.replicate, redundancy=args.redundancy,
        snapshot_every=args.snapshot_every or None, global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch, max_steps=args.steps, checkpoint=url,
        checkpoint_interval=args.interval)

    def release() -> bool:
        return ctx.inplace is not None and ctx.inplace.change_pending()

    if args.explicit:
        _explicit(ctx, dataset, common, args, release)
        return 0
    loop = elastic.ElasticLoop(ctx, data=dataset, seed=11, **common)
    held = -1
    for x, y in loop.batches():
        if loop.step != held:  # the step's first micro-batch
            held = loop.step
            _hold(args.gate_file, loop.step, release)
            time.sleep(args.step_time)
        loop.backward(nn.functional.mse_loss(loop.model(x), y))
    print(f"[sharded-worker] pid={os.getpid()} rank={ctx.rank} stopped at step {loop.step} "
          f"(storage loads {loop.storage_loads})", flush=True)
    return 0


def _explicit(ctx: Any, dataset: Sequences, common: dict[str, Any], args: Any,
              release: Any) -> None:
    """The explicit way: the script writes each step; the audit is written here."""
    from torch.utils.data import DataLoader

    from elastic.loop.audit import IndexedCollate, IndexedDataset, SampleAudit

    audit = SampleAudit.from_env()
    sampler = elastic.ElasticSampler(len(dataset), seed=11)
    with elastic.ElasticLoop(ctx, sampler=sampler, **common) as loop:
        loader = DataLoader(IndexedDataset(dataset), batch_sampler=loop.batch_sampler(),
                            collate_fn=IndexedCollate(None))
        for step in loop:
            heal = ctx.inplace.last_heal if ctx.inplace is not None else None
            if audit is not None:
                audit.world(generation=ctx.generation, rank=ctx.rank, world=ctx.world_size,
                            step=step, storage_loads=loop.storage_loads,
                            received=bool(heal and heal.received),
                            source=heal.source if heal else -1)
            with loop.step_guard():
                _hold(args.gate_file, step, release)
                time.sleep(args.step_time)
                model = loop.module  # this world's sharded model
                for ids, (x, y) in loop.micro_batches(loader, model):
                    if audit is not None:
                        audit.batch(generation=ctx.generation, step=step, rank=ctx.rank,
                                    ids=ids)
                    loop.scale_loss(nn.functional.mse_loss(model(x), y)).backward()
                loop.optimizer.step()
                loop.optimizer.zero_grad(set_to_none=True)
                loop.scheduler.step()
                if audit is not None:
                    audit.done(generation=ctx.generation, step=step, rank=ctx.rank,
                               world=ctx.world_size)
                loop.end_step()
        print(f"[sharded-worker] pid={os.getpid()} rank={ctx.rank} (explicit) stopped at "
              f"step {loop.step} (storage loads {loop.storage_loads})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
