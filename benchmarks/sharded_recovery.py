"""Sharded models in place: recovery from a lost worker against the restart path, and what
the peer copies cost per step.

Six workers (three ``elastic-run`` agents on 127.0.0.1, two workers each, gloo, CPU, an
embedded etcd) train an MLP of ``--layers`` square ``--hidden`` layers, ``fully_shard`` per
layer, with Adam: at the defaults 18.9 M parameters, 226 MB of parameters and Adam state
(38 MB per worker). The worker is this file (``--worker``), written the explicit way; it logs
``time,generation,rank,step,pid,world`` after every completed step. In one invocation:

1. **Step time, copies off and on**: two jobs without faults, ``redundancy=0`` and
   ``redundancy=1`` (the default: peer copies at the automatic cadence, at most 1 % of the
   training time); the median time between two completed steps of rank 0 after
   ``--warmup`` steps. Goal: on / off <= 1.01.
2. **Recovery in place**: a job with copies and checkpoints (every ``--interval`` steps); a
   worker of node 1 is SIGKILLed; recovery is the time from the kill to the first step a
   worker of node 0 completes in the new world (re-sharded from the survivors' shards and the
   lost worker's copy, no storage read), and the steps it went back.
3. **Recovery by restart**: the same job under ``--elastic-mode restart`` (every worker is
   restarted and loads the last checkpoint, re-sharded by DCP into the world it finds); the
   kill comes once a checkpoint is committed; recovery is the time from the kill to the first
   step a new worker completes. Twice: ``restart-cold`` (``--warm-standby off
   --memory-checkpoints off``: fresh processes read the checkpoint from storage, the restart
   path the goal was set against; goal: in place <= 1/5 of this) and ``restart`` (today's
   defaults: the workers restart in warm standbys and read the checkpoint's copy in host
   memory; shown, no goal).

Both recoveries include that first step's compute, and the worlds differ: in place the
survivors train on as 5 ranks, each with a larger share of the fixed global batch (two
micro-batches instead of one), while the restarted job is 6 ranks again. So the goal is
judged on the *stall*: the time to the next step completed, less the step time of the world
that step ran in (the median of its next steps). The table also gives the time from the
kill to the moment that step starts (the heal, or the restart and load alone), from the
``<out>.starts`` log each worker writes at the start of every step.

Prints the load average, a Markdown table with the ratios and goals, and each worker's
copy statistics (refreshes, what one costs, the cadence chosen). ``--json`` writes it all.

Usage::

    python benchmarks/sharded_recovery.py [--runs 1] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_vs_torchrun import (  # a sibling script, not a package
    _kill,
    _start_etcd,
    _tree,
)

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 48
MICRO_BATCH = 8
RECOVERY_GOAL = 0.2  # in place / restart
OVERHEAD_GOAL = 1.01  # step time with copies on / off


# --------------------------------------------------------------------------------------------
# The worker (this same file, run with --worker by each agent)


def worker_main(args: argparse.Namespace) -> int:
    """Train the sharded MLP; log one line per completed step; print the copies' figures."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import elastic

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s"
                        "[%(process)d]: %(message)s")
    ctx = elastic.init("gloo", inplace=True)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(1024, args.hidden, generator=data),
                            torch.randn(1024, args.hidden, generator=data))
    sampler = elastic.ElasticSampler(len(dataset), seed=3)
    with open(args.out, "a") as log, elastic.ElasticLoop(
        ctx, model=nn.Sequential(*layers), parallelize=parallelize,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-4),
        redundancy=args.redundancy, sampler=sampler, max_steps=args.max_steps,
        checkpoint=args.ckpt or None, checkpoint_interval=args.interval,
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
    ) as loop:
        loader = DataLoader(dataset, batch_sampler=loop.batch_sampler())
        started = open(args.out + ".starts", "a")  # noqa: SIM115 (closed below)
        for _ in loop:
            # The moment a step starts: after a change, when the heal is over and training
            # resumes (the recovery's own share, without the next step's compute).
            started.write(f"{time.time():.4f},{ctx.generation},{ctx.rank},{loop.step},"
                          f"{os.getpid()},{ctx.world_size}\n")
            started.flush()
            with loop.step_guard():
                model = loop.module
                for x, y in loop.micro_batches(loader, model):
                    loop.scale_loss(nn.functional.mse_loss(model(x), y)).backward()
                loop.optimizer.step()
                loop.optimizer.zero_grad(set_to_none=True)
                loop.end_step()
                log.write(f"{time.time():.4f},{ctx.generation},{ctx.rank},{loop.step},"
                          f"{os.getpid()},{ctx.world_size}\n")
                log.flush()
        started.close()
        copies = loop._copies
        if copies is not None:
            print("[sharded-bench] " + json.dumps({
                "rank": ctx.rank, "refreshes": copies.refreshes,
                "blocking_ms": round(copies.blocking_s * 1e3, 2),
                "exchange_ms": round(copies.exchange_s * 1e3, 2),
                "steps": loop.step}), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# The driver


@dataclass(frozen=True)
class Row:
    t: float
    gen: int
    rank: int
    step: int
    pid: int
    world: int


def _starts(out: Path) -> Path:
    return out.with_name(out.name + ".starts")


def _rows(out: Path) -> list[Row]:
    rows = []
    if out.exists():
        for line in out.read_text().splitlines():
            parts = line.split(",")
            if len(parts) == 6:
                with contextlib.suppress(ValueError):
                    rows.append(Row(float(parts[0]), *map(int, parts[1:])))  # type: ignore[arg-type]
    return rows


def _wait(out: Path, pred: Any, timeout: float) -> Row | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in _rows(out):
            if pred(row):
                return row
        time.sleep(0.05)
    return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@dataclass
class Job:
    """Three agents of one job, two workers each."""

    name: str
    workdir: Path
    endpoint: str
    mode: str
    worker: list[str]
    flags: list[str] = field(default_factory=list)
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.workdir / f"{self.name}.csv"

    def start(self, nodes: int = 3) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        for i in range(nodes):
            log = open(self.workdir / f"{self.name}.agent{i}.log", "wb")  # noqa: SIM115
            self.agents.append(subprocess.Popen(
                [sys.executable, "-m", "launch", "--etcd", self.endpoint, "--job-id",
                 f"{self.name}-{os.getpid()}", "--elastic-mode", self.mode, "--nnodes", "3",
                 "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.1",
                 *self.flags, *self.worker], stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=REPO, start_new_session=True))

    def stop(self) -> None:
        for agent in self.agents:
            _kill(_tree(agent.pid))
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(30)

    def wait_done(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            agent.wait(max(1.0, deadline - time.monotonic()))

    def copy_stats(self) -> list[dict[str, Any]]:
        found = []
        for log in sorted(self.workdir.glob(f"{self.name}.agent*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "[sharded-bench] " in line:
                    found.append(json.loads(line.split("[sharded-bench] ", 1)[1]))
        return found


def _worker_args(args: argparse.Namespace, out: Path, ckpt: str, redundancy: int,
                 steps: int) -> list[str]:
    return [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--ckpt", ckpt,
            "--redundancy", str(redundancy), "--max-steps", str(steps), "--hidden",
            str(args.hidden), "--layers", str(args.layers), "--interval", str(args.interval)]


def step_time(args: argparse.Namespace, endpoint: str, workdir: Path, redundancy: int,
              tag: str) -> tuple[float, list[dict[str, Any]]]:
    """Median seconds between two completed steps of rank 0 (after the warm-up)."""
    name = f"steps-{tag}"
    job = Job(name, workdir, endpoint, "inplace", [])
    job.worker = _worker_args(args, job.out, "", redundancy, args.steps)
    job.start()
    try:
        job.wait_done(args.timeout)
    finally:
        job.stop()
    times = sorted(r.t for r in _rows(job.out) if r.rank == 0 and r.step > args.warmup)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    if not gaps:
        raise RuntimeError(f"job {name} completed no step past the warm-up; see {workdir}")
    return statistics.median(gaps), job.copy_stats()


#: The recoveries measured: (name, ``--elastic-mode``, more flags). ``restart-cold`` is the
#: restart path as the issue defined it: every worker restarts cold and reads the last
#: checkpoint from storage (DCP). ``restart`` is today's default restart path: warm standbys
#: and the checkpoint's copy in host memory.
RECOVERIES: tuple[tuple[str, str, list[str]], ...] = (
    ("inplace", "inplace", []),
    ("restart", "restart", []),
    ("restart-cold", "restart", ["--warm-standby", "off", "--memory-checkpoints", "off"]),
)


def recovery(args: argparse.Namespace, endpoint: str, workdir: Path, mode: str,
             tag: str, flags: list[str]) -> dict[str, float]:
    """Seconds from a worker's SIGKILL to node 0's first step in the new world, and the steps
    the job went back."""
    name = f"recover-{tag}"
    job = Job(name, workdir, endpoint, mode, [], flags)
    ckpt = workdir / f"{name}-ckpt"
    job.worker = _worker_args(args, job.out, str(ckpt), 1, 10 * args.steps)
    job.start()
    try:
        warm = max(args.warmup, args.interval + 2)
        if _wait(job.out, lambda r: r.step >= warm, args.timeout) is None:
            raise RuntimeError(f"job {name} did not reach step {warm}; see {workdir}")
        if mode == "restart" and _wait(job.out, lambda r: any(ckpt.glob("*/COMMIT.json")),
                                       args.timeout) is None:
            raise RuntimeError(f"job {name} committed no checkpoint; see {workdir}")
        node0 = set(_children(job.agents[0].pid))
        before = _rows(job.out)
        # A worker that trains (with --warm-standby on, some children are idle standbys).
        victim = next(p for p in _children(job.agents[1].pid) if p in {r.pid for r in before})
        old = {(r.pid, r.gen) for r in before}
        reached = max(r.step for r in before)
        t_kill = time.time()
        _kill([victim])
        row = _wait(job.out, lambda r: r.t > t_kill and (r.pid, r.gen) not in old
                    and (r.pid in node0 or mode == "restart"), args.timeout)
        if row is None:
            raise RuntimeError(f"job {name} did not recover within {args.timeout} s")
        reached = max(r.step for r in _rows(job.out) if (r.pid, r.gen) in old)
        resumed = min((r.t for r in _rows(_starts(job.out))
                       if r.t > t_kill and r.gen == row.gen and r.pid == row.pid), default=row.t)
        return {"recovery_s": row.t - t_kill, "resumed_s": resumed - t_kill,
                "steps_lost": max(0, reached - (row.step - 1)),
                "next_world_step_s": _steady_step(job.out, row)}
    finally:
        job.stop()


def _steady_step(out: Path, first: Row, steps: int = 2, timeout: float = 30.0) -> float:
    """The step time of the world that recovered, after its first step (``first``): in place
    that world is smaller (5 ranks, each with a larger share of the fixed global batch, in
    more micro-batches), so its first step is longer than the old world's steps whatever
    the recovery costs. The median of up to ``steps`` steps, until the world changes again
    (the replacement joins) or ``timeout``; NaN if none came."""
    def later() -> list[Row]:
        return sorted((r for r in _rows(out) if r.pid == first.pid and r.gen == first.gen
                       and r.step > first.step), key=lambda r: r.step)
    deadline = time.monotonic() + timeout
    while len(later()) < steps and time.monotonic() < deadline:
        if any(r.gen > first.gen for r in _rows(out)):
            break
        time.sleep(0.05)
    rows = [first, *later()[:steps]]
    gaps = [b.t - a.t for a, b in itertools.pairwise(rows) if b.step == a.step + 1]
    return statistics.median(gaps) if gaps else math.nan


def copies_share(stats: list[dict[str, Any]], step_s: float,
                 with_transfers: bool = False) -> float | None:
    """The copies' own time as a share of the training time, the median over the workers of
    a job with copies: its refreshes times what its last one cost over its steps times the
    step time. The cost is the blocking copy and confirmation; ``with_transfers`` adds the
    background transfers as if they stopped training too (an upper bound: on a GPU node they
    run on idle host cores, here they compete for 2). ``None`` without figures."""
    shares = [s["refreshes"] * (s["blocking_ms"] + (s["exchange_ms"] if with_transfers else 0))
              / 1e3 / (s["steps"] * step_s) for s in stats if s.get("steps")]
    return statistics.median(shares) if shares and step_s > 0 else None


def report(result: dict[str, Any]) -> str:
    """The Markdown table (the rows measured), with ratios to the same run's baselines."""
    def med(key: str) -> float:
        return statistics.median(result[key])

    def finite_med(key: str) -> float:
        values = [v for v in result.get(key, []) if math.isfinite(v)]
        return statistics.median(values) if values else math.nan

    lines = [
        f"load average: {result['load']}",
        "",
        "| measure | in place (copies on) | baseline | ratio | goal | met? |",
        "|---|---|---|---|---|---|",
    ]
    baselines = (("restart-cold", "cold restart + DCP load from storage", True),
                 ("restart", "today's restart path: warm standbys + memory checkpoint", False))
    for key, label, goal in baselines:
        if not (result["inplace_s"] and result.get(f"{key}_s")):
            continue
        inplace, restart = med("inplace_s"), med(f"{key}_s")
        resumed, restarted = med("inplace_resumed_s"), med(f"{key}_resumed_s")
        step_in, step_re = finite_med("inplace_next_step_s"), finite_med(f"{key}_next_step_s")
        stall_in, stall_re = finite_med("inplace_stall_s"), finite_med(f"{key}_stall_s")
        lines += [
            f"| kill to the next step completed (s) | {inplace:.2f} | {restart:.2f} ({label}) "
            f"| {inplace / restart:.3f} | | |",
            f"| of which: kill to training resumed (s) | {resumed:.2f} | {restarted:.2f} | "
            f"{resumed / restarted:.3f} | | |",
            f"| step time of the world after the fault (s) | {step_in:.2f} (5 ranks) | "
            f"{step_re:.2f} (6 ranks) | | | |",
        ]
        if goal:
            met = "yes" if stall_re and stall_in / stall_re <= RECOVERY_GOAL else "no"
            lines.append(
                f"| **recovery: the next step completed, less one step of that world** (s) | "
                f"{stall_in:.2f} | {stall_re:.2f} | {stall_in / stall_re:.3f} | "
                f"<= {RECOVERY_GOAL} | {met} |")
        lines.append(f"| steps lost | {med('inplace_lost'):.0f} | {med(f'{key}_lost'):.0f} "
                     "| | | |")
    if result["step_on_s"] and result["step_off_s"]:
        on, off = med("step_on_s"), med("step_off_s")
        lines.append(f"| step time (s) | {on:.3f} | {off:.3f} (redundancy=0) | {on / off:.4f} | "
                     f"<= {OVERHEAD_GOAL} | {'yes' if on / off <= OVERHEAD_GOAL else 'no'} |")
        share = copies_share(result["copy_stats"], on)
        bound = copies_share(result["copy_stats"], on, with_transfers=True)
        if share is not None and bound is not None:
            # The ratio above is within this machine's noise (6 workers on 2 cores); these
            # are the copies' own times, counted on each worker, against its training time.
            lines += [
                f"| copies' blocking time / training time | {100 * share:.2f} % | | | "
                f"<= {100 * (OVERHEAD_GOAL - 1):.0f} % | "
                f"{'yes' if share <= OVERHEAD_GOAL - 1 else 'no'} |",
                f"| the same, background transfers counted as blocking | {100 * bound:.2f} % "
                "| | | | |",
            ]
    lines += ["", f"state: {result['state_mb']:.0f} MB of parameters and Adam state over 6 "
                  f"workers; runs: {max(len(result['inplace_s']), len(result['step_on_s']))}"]
    stats = result["copy_stats"]
    if stats:
        refreshes = statistics.median(s["refreshes"] for s in stats)
        steps = statistics.median(s["steps"] for s in stats)
        lines.append(
            f"copies (redundancy=1, automatic cadence): {refreshes:.0f} refreshes in "
            f"{steps:.0f} steps (one every {steps / max(refreshes, 1):.1f} steps); last "
            f"refresh blocked {statistics.median(s['blocking_ms'] for s in stats):.1f} ms and "
            f"its transfers took {statistics.median(s['exchange_ms'] for s in stats):.1f} ms "
            "(medians over workers)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="")
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--redundancy", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--interval", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--steps", type=int, default=40, help="steps of the step-time jobs")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", choices=("steps", "recovery"), default=None,
                        help="run only the step-time jobs or only the recovery jobs")
    parser.add_argument("--recoveries", default=",".join(k for k, _, _ in RECOVERIES),
                        help="the recoveries to measure, comma-separated (default: all)")
    parser.add_argument("--workdir", default="")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sharded-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work directory: {workdir}", flush=True)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    result: dict[str, Any] = {
        "state_mb": 3 * 4 * params / 1e6, "load": os.getloadavg(),
        "step_on_s": [], "step_off_s": [], "inplace_s": [], "inplace_lost": [],
        "copy_stats": [],
        **{f"{key}{suffix}": [] for key, _, _ in RECOVERIES
           for suffix in ("_s", "_lost", "_resumed_s", "_next_step_s", "_stall_s")}}
    etcd, endpoint = _start_etcd(workdir)
    try:
        for run in range(args.runs):
            if args.only != "recovery":
                off, _ = step_time(args, endpoint, workdir, 0, f"off{run}")
                on, stats = step_time(args, endpoint, workdir, 1, f"on{run}")
                result["step_off_s"].append(off)
                result["step_on_s"].append(on)
                result["copy_stats"].extend(stats)
            for key, mode, flags in RECOVERIES:
                if args.only == "steps":
                    break
                if key not in args.recoveries.split(","):
                    continue
                measured = recovery(args, endpoint, workdir, mode, f"{key}{run}", flags)
                result[f"{key}_s"].append(measured["recovery_s"])
                result[f"{key}_resumed_s"].append(measured["resumed_s"])
                result[f"{key}_lost"].append(measured["steps_lost"])
                result[f"{key}_next_step_s"].append(measured["next_world_step_s"])
                # The stall: what the fault cost beyond one step of the world it trains in
                # now (NaN when that world took no second step before it changed again).
                result[f"{key}_stall_s"].append(
                    measured["recovery_s"] - measured["next_world_step_s"])
            print(f"run {run}: " + json.dumps({k: v[-1] for k, v in result.items()
                                               if isinstance(v, list) and v
                                               and k != "copy_stats"}), flush=True)
    finally:
        etcd.stop()
    table = report(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "table": table,
                                               "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
