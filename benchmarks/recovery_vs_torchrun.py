"""Recovery times: torchrun (c10d) versus elastic-run on the same 2-node CPU job.

Two agents on 127.0.0.1, one worker each (``--nnodes 1:2 --nproc-per-node 1``, gloo), training
an MLP (256-512-512-10, Adam, DDP) and saving a ``torch.save`` checkpoint every 20 steps. Each
run measures, in order:

1. **first step**: launch of both agents to the first completed step;
2. **worker SIGKILL**: one worker killed, to the first step completed by the restarted workers;
3. **node loss**: the second agent and its worker killed, to the first step of the survivor
   (the job has ``min 1`` so the survivor carries on alone).

A phase that does not recover within ``--hang-timeout`` seconds counts as a hang (the run ends
there). Launchers compared: ``torchrun`` with default settings, ``torchrun`` with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the workaround for pytorch#135712), and
``elastic-run`` (etcd v3 rendezvous on an embedded etcd, default settings). Optionally
``elastic-run-c10d``: our launcher on torch's c10d rendezvous with default settings, which
separates what the agent changes from what the etcd rendezvous changes. Prints a Markdown table
of medians and the ratios against torchrun's defaults.

Usage::

    python benchmarks/recovery_vs_torchrun.py --runs 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("first_step", "worker_kill", "node_loss")
WARMUP_STEPS = 30


# --------------------------------------------------------------------------------------------
# The worker (this same file, run with --worker by each launcher)


def worker_main(out: str, ckpt: str, max_steps: int) -> int:
    """Train until ``max_steps``; log ``time,rank,world,step,pid`` per completed step."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    step = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        step = int(state["step"])
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    while step < max_steps:
        loss = nn.functional.cross_entropy(ddp(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        step += 1
        with open(out, "a") as f:
            f.write(f"{time.time():.4f},{rank},{world},{step},{os.getpid()}\n")
        if rank == 0 and step % 20 == 0:
            tmp = f"{ckpt}.tmp"
            torch.save({"model": model.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        time.sleep(0.02)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------
# The driver


@dataclass
class Run:
    launcher: str
    times: dict[str, float] = field(default_factory=dict)
    hung: list[str] = field(default_factory=list)
    # Per recovery phase: seconds from the kill until the survivor's agent started new workers
    # (failure detection + rendezvous); the rest of the recovery is process start + init.
    to_workers_started: dict[str, float] = field(default_factory=dict)


_TORCH_LOG = re.compile(r"^[IWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+) ")
_STARTING = "Starting worker group"


def _started_after(log: Path, after: float) -> float | None:
    """Wall time of the first "Starting worker group" line (torch's agent log) after ``after``."""
    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        m = _TORCH_LOG.match(line)
        if not m or _STARTING not in line:
            continue
        lt = time.localtime(after)
        month, day = int(m.group(1)[:2]), int(m.group(1)[2:])
        base = time.mktime((lt.tm_year, month, day, 0, 0, 0, 0, 0, -1))
        t = base + int(m.group(2)) * 3600 + int(m.group(3)) * 60 + float(m.group(4))
        if t > after:
            return t
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lines(out: Path) -> list[tuple[float, int, int, int, int]]:
    rows = []
    if out.exists():
        for line in out.read_text().splitlines():
            parts = line.split(",")
            if len(parts) == 5:
                try:
                    t, r, w, s, p = float(parts[0]), *map(int, parts[1:])
                except ValueError:
                    continue
                rows.append((t, r, w, s, p))
    return rows


def _wait_for(out: Path, pred: Any, timeout: float) -> tuple[float, int, int, int, int] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in _lines(out):
            if pred(row):
                return row
        time.sleep(0.05)
    return None


def _wait_listening(endpoint: str, timeout: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                             timeout=10).stdout
    except subprocess.TimeoutExpired:
        return []
    return [int(p) for p in out.split()]


def _tree(pid: int) -> list[int]:
    pids = [pid]
    for child in _children(pid):
        pids.extend(_tree(child))
    return pids


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _agent_cmd(launcher: str, endpoint: str, run_id: str, out: Path, ckpt: Path,
               steps: int) -> list[str]:
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
              "--monitor-interval", "0.1"]
    worker = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--ckpt", str(ckpt),
              "--steps", str(steps)]
    c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    if launcher.startswith("torchrun"):
        return [sys.executable, "-m", "torch.distributed.run", *c10d, *common, *worker]
    if launcher == "elastic-run-c10d":
        return [sys.executable, "-m", "launch", *c10d, *common, *worker]
    return [sys.executable, "-m", "launch", "--etcd", endpoint, "--job-id", run_id, *common,
            *worker]


def one_run(launcher: str, etcd_endpoint: str | None, hang_timeout: float, workdir: Path,
            index: int) -> Run:
    run = Run(launcher)
    out, ckpt = workdir / f"{launcher}-{index}.log", workdir / f"{launcher}-{index}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if launcher == "torchrun-noshare":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    endpoint = etcd_endpoint if launcher == "elastic-run" else f"127.0.0.1:{_free_port()}"
    assert endpoint is not None
    run_id = f"bench-{launcher}-{index}-{os.getpid()}"
    cmd = _agent_cmd(launcher, endpoint, run_id, out, ckpt, steps=100_000)
    logs = [open(workdir / f"{launcher}-{index}-agent{i}.txt", "w") for i in range(2)]  # noqa: SIM115
    agents: list[subprocess.Popen[bytes]] = []
    try:
        t0 = time.time()
        for i in range(2):
            agents.append(subprocess.Popen(cmd, env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                                           start_new_session=True))
            if launcher != "elastic-run" and i == 0:
                _wait_listening(endpoint, hang_timeout)  # agent 0 must host the c10d store
        first = _wait_for(out, lambda r: True, hang_timeout)
        if first is None:
            run.hung.append("first_step")
            return run
        run.times["first_step"] = first[0] - t0
        warm = _wait_for(out, lambda r: r[3] >= WARMUP_STEPS and r[2] == 2, hang_timeout)
        if warm is None:
            run.hung.append("first_step")
            return run

        # Phase 2: SIGKILL the second agent's worker.
        old_pids = {r[4] for r in _lines(out)}
        victim_agent = agents[1]
        victims = _children(victim_agent.pid)
        if not victims:
            run.hung.append("worker_kill")
            return run
        t_kill = time.time()
        _kill(victims)
        rec = _wait_for(out, lambda r: r[0] > t_kill and r[4] not in old_pids, hang_timeout)
        if rec is None:
            run.hung.append("worker_kill")
            return run
        run.times["worker_kill"] = rec[0] - t_kill
        started = _started_after(workdir / f"{launcher}-{index}-agent0.txt", t_kill)
        if started is not None:
            run.to_workers_started["worker_kill"] = started - t_kill
        settled = _wait_for(
            out, lambda r: r[0] > rec[0] + 2 and r[4] not in old_pids and r[2] == 2, hang_timeout
        )
        if settled is None:
            run.hung.append("worker_kill")
            return run

        # Phase 3: lose the second node (agent and worker together).
        tree = _tree(victim_agent.pid)
        t_kill = time.time()
        _kill(tree)
        rec = _wait_for(out, lambda r: r[0] > t_kill and r[2] == 1, hang_timeout)
        if rec is None:
            run.hung.append("node_loss")
            return run
        run.times["node_loss"] = rec[0] - t_kill
        started = _started_after(workdir / f"{launcher}-{index}-agent0.txt", t_kill)
        if started is not None:
            run.to_workers_started["node_loss"] = started - t_kill
        return run
    finally:
        for agent in agents:
            _kill(_tree(agent.pid))
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=30)
        for f in logs:
            f.close()


def _start_etcd(workdir: Path) -> tuple[Any, str]:
    from launch.etcd_server import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=str(workdir / "etcd"))
    server.start()
    return server, server.endpoint


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s" if values else "-"


def report(runs: list[Run], launchers: list[str]) -> str:
    """Render the Markdown table of medians, hang counts and ratios to torchrun's default."""
    med: dict[str, dict[str, float]] = {}
    lines = [
        "| launcher | runs | first step | worker SIGKILL recovery | node loss recovery | hangs |",
        "|---|---|---|---|---|---|",
    ]
    for name in launchers:
        mine = [r for r in runs if r.launcher == name]
        cells = []
        med[name] = {}
        for phase in PHASES:
            vals = [r.times[phase] for r in mine if phase in r.times]
            if vals:
                med[name][phase] = statistics.median(vals)
            cells.append(f"{_median(vals)} (n={len(vals)})")
        hangs = sum(len(r.hung) for r in mine)
        detail = ", ".join(sorted({p for r in mine for p in r.hung}))
        lines.append(f"| {name} | {len(mine)} | {' | '.join(cells)} | {hangs}"
                     f"{f' ({detail})' if detail else ''} |")
    lines.append("")
    lines.append("| launcher | worker SIGKILL: kill -> new workers started | node loss: kill -> "
                 "new workers started |")
    lines.append("|---|---|---|")
    for name in launchers:
        mine = [r for r in runs if r.launcher == name]
        cells = [_median([r.to_workers_started[p] for r in mine if p in r.to_workers_started])
                 for p in ("worker_kill", "node_loss")]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    base = med.get("torchrun-default", {})
    ours = med.get("elastic-run", {})
    ratios = [f"{p}: {base[p] / ours[p]:.1f}x" for p in PHASES if p in base and p in ours
              and ours[p] > 0]
    if ratios:
        lines.append("")
        lines.append("Speed-up of elastic-run over torchrun defaults (median ratio): "
                     + ", ".join(ratios))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one training worker)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hang-timeout", type=float, default=90.0)
    p.add_argument("--launchers", default="torchrun-default,torchrun-noshare,elastic-run")
    p.add_argument("--json", default=None, help="also write the raw runs to this file")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=100_000, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a.out, a.ckpt, a.steps)

    launchers = [x.strip() for x in a.launchers.split(",") if x.strip()]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as tmp:
        workdir = Path(a.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        server, endpoint = (None, None)
        if "elastic-run" in launchers:
            server, endpoint = _start_etcd(workdir)
        try:
            for i in range(a.runs):
                for name in launchers:
                    run = one_run(name, endpoint, a.hang_timeout, workdir, i)
                    print(f"run {i} {name}: {run.times} hung={run.hung}", file=sys.stderr,
                          flush=True)
                    runs.append(run)
        finally:
            if server is not None:
                server.stop()
    print(report(runs, launchers))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
