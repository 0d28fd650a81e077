"""The managed loop's own cost per step, in place, against plain DDP on the same job.

One job, two ways, side by side, in interleaved blocks (plain, managed, managed, plain, ...)
so that both see the same machine load:

* **managed**: ``elastic-run --standalone --nproc-per-node 2`` (defaults: in place, as every
  ``ElasticLoop`` script runs) training with ``ElasticLoop(model=, optimizer=, data=)``,
  checkpointing off: the loop owns DDP, the optimizer step, the sampler and the loader, and
  runs its per-step agreement (drain, newer world) and its in-place bookkeeping;
* **plain**: the same model on the same data the usual way: ``DistributedDataParallel``,
  ``DistributedSampler``, ``DataLoader``, the optimizer step, a plain torch script under the
  same launcher (``--plain-launcher elastic-run``, the default, runs it as torchrun would, so
  that only the loop differs; ``torchrun`` is the alternative).

The job: a small float64 MLP (32-64-64-1, tanh), MSE on 8192 synthetic samples, SGD, global
batch 64 (32 per rank, one micro-batch per step), 2 ranks over gloo, one torch thread each.
Each worker times its steps after ``--warmup`` steps (wall clock between the starts of
consecutive steps, and its CPU time); a block's step time is the mean over its ranks. The
overhead is managed minus plain over each pair of adjacent blocks (median over the pairs);
the goal is at most 0.3 ms.

Usage::

    python benchmarks/loop_overhead.py [--repeats 5] [--steps 600] [--warmup 100]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GOAL_MS = 0.3
NPROC = 2
GLOBAL_BATCH = 64
DATASET = 8192


@dataclass
class Result:
    """Step times per block, in the order the blocks ran."""

    steps: int
    warmup: int
    plain_launcher: str = "elastic-run"
    blocks: list[dict[str, Any]] = field(default_factory=list)
    """``{"mode", "step_s", "cpu_s"}`` per block (means over the ranks)."""

    def of(self, mode: str, key: str = "step_s") -> list[float]:
        return [b[key] for b in self.blocks if b["mode"] == mode]

    @property
    def pair_overheads_s(self) -> list[float]:
        """Managed minus plain, for each repeat's two adjacent blocks."""
        out = []
        for i in range(0, len(self.blocks) - 1, 2):
            a, b = self.blocks[i], self.blocks[i + 1]
            managed, plain = (a, b) if a["mode"] == "managed" else (b, a)
            out.append(managed["step_s"] - plain["step_s"])
        return out

    @property
    def overhead_s(self) -> float:
        return statistics.median(self.pair_overheads_s)

    @property
    def cpu_overhead_s(self) -> float:
        pairs = []
        for i in range(0, len(self.blocks) - 1, 2):
            a, b = self.blocks[i], self.blocks[i + 1]
            managed, plain = (a, b) if a["mode"] == "managed" else (b, a)
            pairs.append(managed["cpu_s"] - plain["cpu_s"])
        return float(statistics.median(pairs))


def schedule(repeats: int) -> list[str]:
    """plain-managed, managed-plain, ... (``2 * repeats`` blocks)."""
    out: list[str] = []
    for r in range(repeats):
        out += ["plain", "managed"] if r % 2 == 0 else ["managed", "plain"]
    return out


# --------------------------------------------------------------------------------- the worker


def _dataset() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(DATASET, 32, generator=generator, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(32, 1, generator=generator, dtype=torch.float64))
    return TensorDataset(x, y)


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1)).double()


def _worker(mode: str, steps: int, warmup: int, out: str) -> int:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    marks: list[tuple[float, float]] = []  # (wall, cpu) at the start of each step
    if mode == "managed":
        import elastic

        ctx = elastic.init()
        rank = ctx.rank
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        loop = elastic.ElasticLoop(ctx, model=model, optimizer=optimizer, data=_dataset(),
                                   seed=1, global_batch_size=GLOBAL_BATCH,
                                   micro_batch_size=GLOBAL_BATCH // NPROC, max_steps=steps,
                                   checkpoint=None)
        for x, y in loop.batches():
            marks.append((time.perf_counter(), time.process_time()))
            loop.backward(nn.functional.mse_loss(loop.model(x), y))
        marks.append((time.perf_counter(), time.process_time()))
        ctx.close()
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DataLoader, DistributedSampler

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        model = DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        data = _dataset()
        sampler: DistributedSampler[Any] = DistributedSampler(data, shuffle=True, seed=1)
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // NPROC, sampler=sampler,
                            drop_last=True)
        step, epoch = 0, 0
        while step < steps:
            sampler.set_epoch(epoch)
            for x, y in loader:
                marks.append((time.perf_counter(), time.process_time()))
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if step == steps:
                    break
            epoch += 1
        marks.append((time.perf_counter(), time.process_time()))
        dist.destroy_process_group()
    timed = marks[warmup:]
    n = len(timed) - 1
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "steps": n, "step_s": (timed[-1][0] - timed[0][0]) / n,
        "cpu_s": (timed[-1][1] - timed[0][1]) / n}))
    return 0


# --------------------------------------------------------------------------------- the parent


def run_block(mode: str, steps: int, warmup: int, workdir: Path,
              plain_launcher: str = "elastic-run") -> dict[str, Any]:
    """One job of ``mode`` under its launcher; the mean over its ranks."""
    out = workdir / f"block-{time.monotonic_ns()}"
    out.mkdir()
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone"]
                if mode == "plain" and plain_launcher == "torchrun"
                else [sys.executable, "-m", "launch", "--standalone"])
    cmd = [*launcher, "--nproc-per-node", str(NPROC), str(Path(__file__).resolve()),
           "--worker", mode, "--steps", str(steps), "--warmup", str(warmup), "--out",
           str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("ELASTIC_MODE", None)  # elastic-run's default, not the shell's
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} block failed ({done.returncode}): {done.stderr[-2000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != NPROC:
        raise RuntimeError(f"{mode} block: {len(ranks)} of {NPROC} ranks reported")
    return {"mode": mode, "step_s": statistics.mean(r["step_s"] for r in ranks),
            "cpu_s": statistics.mean(r["cpu_s"] for r in ranks)}


def table(result: Result) -> str:
    """The result as Markdown."""
    def ms(values: list[float]) -> str:
        return (f"{1e3 * statistics.median(values):.3f} ms ({1e3 * min(values):.3f}-"
                f"{1e3 * max(values):.3f})")

    pairs = result.pair_overheads_s
    met = result.overhead_s * 1e3 <= GOAL_MS
    return "\n".join([
        f"Step time of one job ({NPROC} ranks, gloo, float64 MLP 32-64-64-1, global batch "
        f"{GLOBAL_BATCH}), {result.steps} steps per block, the first {result.warmup} "
        f"untimed, {len(pairs)} pairs of interleaved blocks.",
        "",
        "| way | blocks | step time, median (min-max) | CPU per step, median (min-max) |",
        "|---|---:|---:|---:|",
        f"| plain DDP + DistributedSampler + DataLoader ({result.plain_launcher}) | "
        f"{len(result.of('plain'))} | {ms(result.of('plain'))} | "
        f"{ms(result.of('plain', 'cpu_s'))} |",
        f"| ElasticLoop, managed, in place, checkpointing off (elastic-run) | "
        f"{len(result.of('managed'))} | {ms(result.of('managed'))} | "
        f"{ms(result.of('managed', 'cpu_s'))} |",
        "",
        f"- the loop's own cost per step (managed - plain, median of the adjacent pairs): "
        f"**{1e3 * result.overhead_s:.3f} ms** (pairs {1e3 * min(pairs):.3f} to "
        f"{1e3 * max(pairs):.3f} ms); CPU per step: {1e3 * result.cpu_overhead_s:.3f} ms",
        f"- goal: at most {GOAL_MS} ms over plain DDP: {'met' if met else 'NOT met'}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="pairs of blocks")
    parser.add_argument("--steps", type=int, default=600, help="steps per block")
    parser.add_argument("--warmup", type=int, default=100, help="untimed steps per block")
    parser.add_argument("--plain-launcher", choices=("elastic-run", "torchrun"),
                        default="elastic-run",
                        help="what runs the plain job (default elastic-run, which runs a plain "
                        "script as torchrun would: the same launcher on both sides)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    parser.add_argument("--worker", choices=("managed", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup + 2 > args.steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by 2")
    if args.worker:
        return _worker(args.worker, args.steps, args.warmup, args.out)
    result = Result(steps=args.steps, warmup=args.warmup, plain_launcher=args.plain_launcher)
    with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp:
        for mode in schedule(args.repeats):
            block = run_block(mode, args.steps, args.warmup, Path(tmp), args.plain_launcher)
            result.blocks.append(block)
            print(f"{mode:8s} {1e3 * block['step_s']:.3f} ms/step  CPU "
                  f"{1e3 * block['cpu_s']:.3f} ms/step", file=sys.stderr, flush=True)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps({
            **asdict(result), "pair_overheads_s": result.pair_overheads_s,
            "overhead_s": result.overhead_s, "cpu_overhead_s": result.cpu_overhead_s,
            "goal_s": GOAL_MS / 1e3}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
