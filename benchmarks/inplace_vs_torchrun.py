"""Recovery in place versus restarts: torchrun, elastic-run restart mode, elastic-run in place.

The same 2-node CPU job under three launchers: two agents on 127.0.0.1, one worker each
(``--nnodes 1:2 --nproc-per-node 1 --max-restarts 3 --monitor-interval 0.1``, gloo). The worker
is one script written against the elastic API (``elastic.init``, ``ElasticLoop`` with
``step_guard``, ``loop.data_parallel``, ``ElasticSampler``, a ``CheckpointManager`` saving every
20 steps): an MLP (256-512-512-10, Adam, DDP), global batch 64, 20 ms of other work per step.

* ``torchrun``: torch's c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it
  torchrun hangs on restart, pytorch#135712); every membership change restarts every worker,
  which restores the last checkpoint;
* ``elastic-run-restart``: ``elastic-run --elastic-mode restart`` on an embedded etcd (the same
  restart-and-restore recovery, with our agent and rendezvous);
* ``elastic-run-inplace``: ``elastic-run --elastic-mode inplace``: survivors keep running,
  rebuild their process groups and heal newcomers from memory (default ``--inplace-ttl 3``).

Each run: both agents start, the job trains 30 steps in a world of 2, then

1. **worker SIGKILL**: node 1's worker is killed;
2. the job is back to a world of 2 (replacement admitted / workers restarted) for 5 steps;
3. **node loss**: node 1's agent and worker are killed together.

Every worker appends ``time,rank,world,step,pid,ppid,generation`` after each completed step
(``step`` counts completed steps). **Recovery** is measured on node 0 (the survivor): from the
kill to the first step node 0 completes in a new world (a new process or a new generation).
**Steps redone**: the highest step completed in the old world minus the steps the new world
did not have to train again (``old_max - (first_new - 1)``, at least 0). A phase that does not
recover within ``--hang-timeout`` seconds is a hang. Prints the load average and a Markdown
table (medians, min-max, ratios against torchrun within the same invocation).

Usage::

    python benchmarks/inplace_vs_torchrun.py --runs 5 [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_vs_torchrun import (  # a sibling script, not a package
    _free_port,
    _kill,
    _start_etcd,
    _tree,
    _wait_listening,
)

REPO = Path(__file__).resolve().parents[1]
LAUNCHERS = ("torchrun", "elastic-run-restart", "elastic-run-inplace")
PHASES = ("worker_kill", "node_loss")
WARMUP_STEPS = 30
SETTLE_STEPS = 5
INTERVAL = 20
GLOBAL_BATCH = 64


# --------------------------------------------------------------------------------------------
# The worker (this same file, run with --worker by each launcher)


def worker_main(out: str, ckpt_dir: str, max_steps: int) -> int:
    """Train with the elastic API; log one line per completed step."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import elastic
    from checkpointing import CheckpointManager, ModelOptimizerState

    ctx = elastic.init(inplace=True)  # written for in place; restart modes ignore it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(4096, 256, generator=data),
                            torch.randint(0, 10, (4096,), generator=data))
    sampler = elastic.ElasticSampler(len(dataset), seed=3, shuffle=True)
    checkpoint = CheckpointManager(ckpt_dir, process_group=ctx.checkpoint_group, round=ctx.round)
    ppid = os.getppid()
    with open(out, "a") as log, elastic.ElasticLoop(
        ctx, state={"train": ModelOptimizerState(model, optimizer)}, checkpoint=checkpoint,
        sampler=sampler, max_steps=max_steps, checkpoint_interval=INTERVAL,
        global_batch_size=GLOBAL_BATCH,
    ) as loop:
        loader: DataLoader[Any] | None = None
        for _ in loop:
            with loop.step_guard():
                if loader is None or loader.batch_size != loop.micro_batch_size:
                    loader = DataLoader(dataset, batch_size=loop.micro_batch_size,
                                        sampler=sampler)
                ddp = loop.data_parallel(model)
                for x, y in loop.micro_batches(loader, ddp):
                    loop.scale_loss(nn.functional.cross_entropy(ddp(x), y)).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loop.end_step()
                log.write(f"{time.time():.4f},{ctx.rank},{ctx.world_size},{loop.step},"
                          f"{os.getpid()},{ppid},{ctx.generation}\n")
                log.flush()
            time.sleep(0.02)
    return 0


# --------------------------------------------------------------------------------------------
# The driver


@dataclass(frozen=True)
class Row:
    t: float
    rank: int
    world: int
    step: int
    pid: int
    ppid: int
    gen: int

    @property
    def key(self) -> tuple[int, int]:
        """Which world (process and generation) the step belongs to."""
        return self.pid, self.gen


@dataclass
class Run:
    launcher: str
    times: dict[str, float] = field(default_factory=dict)
    redone: dict[str, int] = field(default_factory=dict)
    hung: list[str] = field(default_factory=list)


def _rows(out: Path) -> list[Row]:
    rows = []
    if out.exists():
        for line in out.read_text().splitlines():
            parts = line.split(",")
            if len(parts) != 7:
                continue
            try:
                rows.append(Row(float(parts[0]), *map(int, parts[1:])))  # type: ignore[arg-type]
            except ValueError:
                continue  # a line being written right now
    return rows


def _wait_rows(out: Path, pred: Any, timeout: float) -> Row | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in _rows(out):
            if pred(row):
                return row
        time.sleep(0.02)
    return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _agent_cmd(launcher: str, endpoint: str, run_id: str, out: Path, ckpt: Path) -> list[str]:
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
              "--monitor-interval", "0.1"]
    worker = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--ckpt", str(ckpt)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *common, *worker]
    mode = launcher.rsplit("-", 1)[1]
    return [sys.executable, "-m", "launch", "--etcd", endpoint, "--job-id", run_id,
            "--elastic-mode", mode, *common, *worker]


def _measure(run: Run, phase: str, out: Path, survivor: int, t_kill: float,
             hang_timeout: float) -> Row | None:
    """Recovery time and steps redone of one phase (``None``: it hung)."""
    before = [r for r in _rows(out) if r.t <= t_kill]
    old_keys = {r.key for r in before}
    rec = _wait_rows(out, lambda r: r.ppid == survivor and r.t > t_kill
                     and r.key not in old_keys, hang_timeout)
    if rec is None:
        run.hung.append(phase)
        return None
    old_max = max((r.step for r in _rows(out) if r.key in old_keys), default=0)
    run.times[phase] = rec.t - t_kill
    run.redone[phase] = max(0, old_max - (rec.step - 1))
    return rec


def one_run(launcher: str, etcd_endpoint: str, hang_timeout: float, workdir: Path,
            index: int) -> Run:
    run = Run(launcher)
    out, ckpt = workdir / f"{launcher}-{index}.csv", workdir / f"{launcher}-{index}-ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    endpoint = etcd_endpoint if launcher != "torchrun" else f"127.0.0.1:{_free_port()}"
    run_id = f"bench-{launcher}-{index}-{os.getpid()}"
    cmd = _agent_cmd(launcher, endpoint, run_id, out, ckpt)
    logs = [open(workdir / f"{launcher}-{index}-agent{i}.txt", "w") for i in range(2)]  # noqa: SIM115
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(2):
            agents.append(subprocess.Popen(cmd, env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                                           cwd=REPO, start_new_session=True))
            if launcher == "torchrun" and i == 0:
                _wait_listening(endpoint, hang_timeout)  # agent 0 hosts the c10d store
        survivor, victim = agents[0].pid, agents[1].pid
        if _wait_rows(out, lambda r: r.world == 2 and r.step >= WARMUP_STEPS,
                      hang_timeout * 2) is None:
            run.hung.append("start")
            return run

        # 1. SIGKILL node 1's worker.
        workers = _children(victim)
        if not workers:
            run.hung.append("worker_kill")
            return run
        t_kill = time.time()
        _kill(workers)
        rec = _measure(run, "worker_kill", out, survivor, t_kill, hang_timeout)
        if rec is None:
            return run
        # 2. Back to a world of 2 (node 1's new worker trains) for a few steps.
        back = _wait_rows(out, lambda r: r.t > rec.t and r.ppid == victim and r.world == 2,
                          hang_timeout)
        if back is None or _wait_rows(out, lambda r: r.step >= back.step + SETTLE_STEPS
                                      and r.world == 2, hang_timeout) is None:
            run.hung.append("node_loss")
            return run

        # 3. Lose node 1: its agent and worker together.
        tree = _tree(victim)
        t_kill = time.time()
        _kill(tree)
        _measure(run, "node_loss", out, survivor, t_kill, hang_timeout)
        return run
    finally:
        for agent in agents:
            _kill(_tree(agent.pid))
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=30)
        for f in logs:
            f.close()


def _cell(values: list[float], unit: str = " s", digits: int = 2) -> str:
    if not values:
        return "-"
    return (f"{statistics.median(values):.{digits}f}{unit} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def report(runs: list[Run], launchers: list[str], load: tuple[float, float]) -> str:
    """The Markdown table: median (min-max) recovery and steps redone, hangs, ratios."""
    lines = [
        f"Load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f} on "
        f"{os.cpu_count()} CPUs.",
        "",
        "| launcher | runs | worker SIGKILL: recovery | steps redone | node loss: recovery "
        "| steps redone | hangs |",
        "|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for name in launchers:
        mine = [r for r in runs if r.launcher == name]
        cells = []
        medians[name] = {}
        for phase in PHASES:
            times = [r.times[phase] for r in mine if phase in r.times]
            redone = [float(r.redone[phase]) for r in mine if phase in r.redone]
            if times:
                medians[name][phase] = statistics.median(times)
            cells += [f"{_cell(times)} n={len(times)}", _cell(redone, "", 0)]
        hangs = sorted(p for r in mine for p in r.hung)
        which = " (" + ", ".join(hangs) + ")" if hangs else ""
        lines.append(f"| {name} | {len(mine)} | {' | '.join(cells)} | {len(hangs)}{which} |")
    base = medians.get("torchrun", {})
    for name in launchers:
        if name == "torchrun":
            continue
        ratios = [f"{p.replace('_', ' ')} {base[p] / medians[name][p]:.1f}x" for p in PHASES
                  if p in base and p in medians[name] and medians[name][p] > 0]
        if ratios:
            lines.append("")
            lines.append(f"{name} vs torchrun (ratio of medians, higher is faster): "
                         + ", ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one training worker)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hang-timeout", type=float, default=90.0)
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--json", default=None, help="also write the raw runs to this file")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=1_000_000, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a.out, a.ckpt, a.steps)

    launchers = [x.strip() for x in a.launchers.split(",") if x.strip()]
    unknown = sorted(set(launchers) - set(LAUNCHERS))
    if unknown:
        p.error(f"--launchers {','.join(unknown)} unknown; choose from {','.join(LAUNCHERS)}.")
    runs: list[Run] = []
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="inplace-bench-") as tmp:
        workdir = Path(a.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        server, endpoint = _start_etcd(workdir)
        try:
            for i in range(a.runs):
                for name in launchers:  # interleaved: load drifts hit every launcher alike
                    run = one_run(name, endpoint, a.hang_timeout, workdir, i)
                    print(f"run {i} {name}: {run.times} redone={run.redone} hung={run.hung} "
                          f"load={os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                    runs.append(run)
        finally:
            server.stop()
    print(report(runs, launchers, (load_start, os.getloadavg()[0])))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
