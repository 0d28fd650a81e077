"""The restart path, part by part: elastic-run (restart mode) against torchrun in one run.

Three nodes on 127.0.0.1 (one agent each, ``--nnodes 2:3 --nproc-per-node 1``) run the plain
torchrun script ``examples/train_torchrun.py`` (float64, Adam, DDP over gloo, its own
``torch.save`` checkpoints) under each launcher in turn:

* ``elastic-run``: this tree's launcher, default flags, on one real etcd (plus
  ``--events-dir``, whose records give the agent's side of the parts);
* ``elastic-run-off``: this tree's launcher with ``--warm-standby off --memory-checkpoints
  off`` (the restart path without its two caches: "before" with the same code);
* ``elastic-run-base``: the same from another checkout (``--baseline-tree``), to compare
  code before and after a change in the same run;
* ``torchrun``: torch's c10d rendezvous hosted by node 0, with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it restarts hang, pytorch#135712) and
  tuned rendezvous timeouts (``last_call_timeout=1,keep_alive_interval=1,
  keep_alive_max_attempt=3``; its defaults take 45 s to drop a node) as a fair baseline.

Two faults per run, once the job trains in a world of 3 (and, under elastic-run, once every
node's warm standby has finished importing: one is started a few seconds after each restart;
the seconds waited are in the JSON):

1. **worker**: the worker of node 1 is SIGKILLed;
2. **node**: node 2's whole process tree (agent, worker, anything else it started) is
   SIGKILLed at once; the job goes on with 2 nodes.

The **stall** is the time from the kill until every rank of the next world has completed a
step. It is split into parts on node 0 (a survivor of both faults), each the time from the
previous milestone (or the kill) to the next one:

=================  ========================================================================
teardown           until node 0's old worker has exited (detection included)
rendezvous         until node 0's agent knows the next world (elastic-run: its
                   ``round_started`` event; torchrun: its "Rendezvous complete" log line)
spawn              until the agent started (or handed the world to) the new worker
interpreter        until the script's first line runs
imports            the script's imports (torch, ...)
init_pg            ``init_process_group``
build              model, DDP and optimizer construction
ckpt_load          finding and loading the newest checkpoint
first_step         until every rank completed its first step
=================  ========================================================================

A part that ended before the previous one (the world was agreed while the old worker was
still exiting, say) counts 0: the parts add up to the stall. Each figure is the median over
``--runs``.

Before and after a change, with torchrun, in one run (``DIR``: a checkout of the code
before, e.g. ``git worktree add --detach /tmp/before <commit>``)::

    python benchmarks/restart_path.py --runs 3 --launchers elastic-run,elastic-run-base,torchrun \
        --baseline-tree DIR [--json out.json]

The two caches on and off, with torchrun, in one run (no other checkout needed)::

    python benchmarks/restart_path.py --runs 3 --launchers elastic-run,elastic-run-off,torchrun
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery_vs_torchrun import _children, _tree  # a sibling script, not a package

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_torchrun.py"
FAULTS = ("worker", "node")
PARTS = ("teardown", "rendezvous", "spawn", "interpreter", "imports", "init_pg", "build",
         "ckpt_load", "first_step")
TORCHRUN_RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
_TORCH_LOG = re.compile(r"^\[?[IWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+) ")
NODES = 3


@dataclass
class Fault:
    """One fault of one run: the stall, and node 0's milestones (seconds after the kill)."""

    stall: float | None = None
    #: Seconds waited before the fault for elastic-run's standbys to finish importing.
    standby_wait: float = 0.0
    #: The machine's 1-minute load average when the fault was injected.
    load: float = 0.0
    milestones: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)
    note: str = ""


@dataclass
class Run:
    launcher: str
    index: int
    faults: dict[str, Fault] = field(default_factory=dict)
    error: str = ""


# --------------------------------------------------------------------------------------------
# Processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


class ExitWatch:
    """Polls pids every 5 ms and records when each stopped running (zombies count as gone)."""

    def __init__(self, pids: list[int]) -> None:
        self.exited: dict[int, float] = {}
        self._pids = list(pids)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set() and len(self.exited) < len(self._pids):
            for pid in self._pids:
                if pid not in self.exited and not _alive(pid):
                    self.exited[pid] = time.time()
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# --------------------------------------------------------------------------------------------
# What the workers and agents wrote


def _timing(directory: Path) -> dict[int, list[dict[str, Any]]]:
    """pid -> that worker's timing records."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in directory.glob("rank*.jsonl"):
        records = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
        if records:
            out[int(records[0]["pid"])] = records
    return out


def _first(records: list[dict[str, Any]], event: str) -> dict[str, Any] | None:
    return next((r for r in records if r.get("event") == event), None)


def _torch_log_times(log: Path, needle: str, after: float) -> float | None:
    """Wall time of the first torch agent log line containing ``needle`` after ``after``."""
    if not log.exists():
        return None
    lt = time.localtime(after)
    for line in log.read_text(errors="replace").splitlines():
        match = _TORCH_LOG.match(line)
        if not match or needle not in line:
            continue
        month, day = int(match.group(1)[:2]), int(match.group(1)[2:])
        base = time.mktime((lt.tm_year, month, day, 0, 0, 0, 0, 0, -1))
        t = base + int(match.group(2)) * 3600 + int(match.group(3)) * 60 + float(match.group(4))
        if t > after:
            return t
    return None


def _agent_events(directory: Path, agent_pid: int, event: str, after: float) -> float | None:
    """Time of ``agent_pid``'s first ``event`` after ``after`` in the elastic-run event log."""
    best = None
    for path in directory.glob(f"*.agent.*.{agent_pid}.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == event and record["time"] > after:
                    best = record["time"] if best is None else min(best, record["time"])
    return best


# --------------------------------------------------------------------------------------------
# One run


class Job:
    """Three agents of one launcher running the script; knows which worker is whose."""

    def __init__(self, launcher: str, index: int, workdir: Path, etcd: str | None,
                 baseline: Path | None, step_time: float) -> None:
        self.launcher = launcher
        self.root = workdir / f"{launcher}-{index}"
        self.timing_dir = self.root / "timing"
        self.events_dir = self.root / "events"
        self.agents: list[subprocess.Popen[bytes]] = []
        self.logs = [self.root / f"agent{i}.log" for i in range(NODES)]
        self.root.mkdir(parents=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO")
        tree = baseline if launcher == "elastic-run-base" and baseline else REPO
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
        worker = [str(SCRIPT), "--checkpoint-dir", str(self.root / "ckpt"), "--steps",
                  "1000000", "--checkpoint-every", "10", "--step-time", str(step_time),
                  "--timing-log", str(self.timing_dir)]
        job_id = f"restart-{launcher}-{index}-{os.getpid()}"
        common = ["--nnodes", f"2:{NODES}", "--nproc-per-node", "1"]
        self.port = None
        if launcher == "torchrun":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            self.port = _free_port()
            self.argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend",
                         "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id",
                         job_id, "--rdzv-conf", TORCHRUN_RDZV, "--max-restarts", "10",
                         "--monitor-interval", "0.1", *common, *worker]
        else:
            assert etcd is not None
            caches = (["--warm-standby", "off", "--memory-checkpoints", "off"]
                      if launcher == "elastic-run-off" else [])
            self.argv = [sys.executable, "-m", "launch", "--etcd", etcd, "--job-id", job_id,
                         "--events-dir", str(self.events_dir), *caches, *common, *worker]
        self.env = env

    def start(self, timeout: float) -> None:
        for i in range(NODES):
            log = open(self.logs[i], "wb")  # noqa: SIM115 - the child holds it
            self.agents.append(subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                                env=self.env, cwd=self.root,
                                                start_new_session=True))
            log.close()
            if self.port is not None and i == 0:
                _wait_listening(self.port, timeout)  # node 0 hosts torchrun's c10d store

    def stop(self) -> None:
        for agent in self.agents:
            _kill(_tree(agent.pid))
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=30)

    def wait_standbys(self, timeout: float) -> float:
        """Waits until no live agent has a standby still importing (elastic-run keeps one
        per slot, started a few seconds after each restart); returns the seconds waited."""
        from launch.standby import standby_state

        started = time.monotonic()
        while time.monotonic() - started < timeout:
            warming = [pid for agent in self.agents if agent.poll() is None
                       for pid in _children(agent.pid) if standby_state(pid) == "warming"]
            if not warming:
                break
            time.sleep(0.1)
        return time.monotonic() - started

    def worker_of(self, node: int, world: int, after: float) -> int | None:
        """The pid of node ``node``'s worker that steps in a world of ``world`` after
        ``after``."""
        mine = set(_tree(self.agents[node].pid))
        for pid, records in _timing(self.timing_dir).items():
            if pid in mine and any(r["event"] == "step" and r["world"] == world
                                   and r["time"] > after for r in records):
                return pid
        return None

    def wait_world(self, world: int, after: float, timeout: float, new_pids: bool,
                   old: set[int]) -> dict[int, list[dict[str, Any]]] | None:
        """Waits until ``world`` ranks step in a world of ``world`` after ``after`` (from
        processes not in ``old`` if ``new_pids``); returns their records."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = {pid: recs for pid, recs in _timing(self.timing_dir).items()
                     if (not new_pids or pid not in old) and any(
                         r["event"] == "step" and r["world"] == world and r["time"] > after
                         for r in recs)}
            if len(found) >= world:
                return found
            if all(a.poll() is not None for a in self.agents):
                return None
            time.sleep(0.05)
        return None


def _milestones(job: Job, kill: float, old_exit: float | None, new: list[dict[str, Any]],
                stall_at: float) -> dict[str, float]:
    """Node 0's milestones after the kill (absolute wall times)."""
    agent = job.agents[0].pid
    started = _first(new, "started") or {}
    if job.launcher == "torchrun":
        agreed = _torch_log_times(job.logs[0], "Rendezvous complete", kill)
        spawned = started.get("process_started")
    else:
        agreed = _agent_events(job.events_dir, agent, "round_started", kill)
        spawned = _agent_events(job.events_dir, agent, "workers_started", kill)
    points: dict[str, float | None] = {
        "teardown": old_exit, "rendezvous": agreed, "spawn": spawned,
        "interpreter": started.get("time"),
        "imports": (_first(new, "imported") or {}).get("time"),
        "init_pg": (_first(new, "process_group") or {}).get("time"),
        "build": (_first(new, "built") or {}).get("time"),
        "ckpt_load": (_first(new, "loaded") or {}).get("time"),
        "first_step": stall_at,
    }
    return {k: v for k, v in points.items() if v is not None}


def _parts(kill: float, milestones: dict[str, float]) -> dict[str, float]:
    parts, previous = {}, kill
    for name in PARTS:
        at = milestones.get(name)
        if at is None:
            continue
        parts[name] = max(0.0, at - previous)
        previous = max(previous, at)
    return parts


def _fault(job: Job, kind: str, timeout: float) -> Fault:
    world = NODES if kind == "worker" else NODES - 1
    now = time.time()
    survivors = [0, 2] if kind == "worker" else [0, 1]
    pids = {node: job.worker_of(node, NODES, now - 1.0) for node in range(NODES)}
    if any(p is None for p in pids.values()):
        return Fault(note=f"could not find every node's worker: {pids}")
    old = {p for p in pids.values() if p is not None}
    watch = ExitWatch([pids[n] for n in survivors if pids[n] is not None])
    victims = [pids[1]] if kind == "worker" else _tree(job.agents[2].pid)
    kill = time.time()
    _kill([p for p in victims if p is not None])
    found = job.wait_world(world, kill, timeout, new_pids=True, old=old)
    watch.stop()
    if found is None:
        return Fault(note=f"no world of {world} within {timeout:.0f} s")
    firsts = {pid: next(r["time"] for r in recs if r["event"] == "step"
                        and r["world"] == world and r["time"] > kill)
              for pid, recs in found.items()}
    stall_at = max(firsts.values())
    mine = set(_tree(job.agents[0].pid))
    new0 = next((recs for pid, recs in found.items() if pid in mine), [])
    old_exit = watch.exited.get(pids[0]) if pids[0] is not None else None
    milestones = _milestones(job, kill, old_exit, new0, stall_at)
    return Fault(stall=stall_at - kill,
                 milestones={k: round(v - kill, 4) for k, v in milestones.items()},
                 parts={k: round(v, 4) for k, v in _parts(kill, milestones).items()})


def one_run(launcher: str, index: int, workdir: Path, etcd: str | None,
            baseline: Path | None, args: argparse.Namespace) -> Run:
    run = Run(launcher, index)
    job = Job(launcher, index, workdir, etcd, baseline, args.step_time)
    try:
        start = time.time()
        job.start(args.hang_timeout)
        if job.wait_world(NODES, start, args.hang_timeout, new_pids=False, old=set()) is None:
            run.error = "the job never trained in a world of 3"
            return run
        for kind in FAULTS:
            time.sleep(args.settle)  # trains a while (and refills what a restart used up)
            waited = job.wait_standbys(args.hang_timeout)
            load = os.getloadavg()[0]
            fault = _fault(job, kind, args.hang_timeout)
            fault.standby_wait = round(waited, 2)
            fault.load = round(load, 1)
            run.faults[kind] = fault
            print(f"  {launcher} run {index} {kind} kill: stall "
                  f"{fault.stall if fault.stall is None else round(fault.stall, 2)} s "
                  f"{fault.parts} {fault.note}", file=sys.stderr, flush=True)
            if fault.stall is None:
                run.error = fault.note
                return run
        return run
    finally:
        job.stop()
        if not args.keep:
            shutil.rmtree(job.root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Report


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(runs: list[Run], launchers: list[str]) -> str:
    """Markdown: per launcher and fault, the median stall and median parts (seconds)."""
    lines = ["| launcher | fault | runs | stall | " + " | ".join(PARTS) + " |",
             "|---|---|---|---|" + "---|" * len(PARTS)]
    for name in launchers:
        for kind in FAULTS:
            faults = [r.faults[kind] for r in runs if r.launcher == name and kind in r.faults
                      and r.faults[kind].stall is not None]
            stall = _median([f.stall for f in faults if f.stall is not None])
            parts = [_cell(_median([f.parts[p] for f in faults if p in f.parts]))
                     for p in PARTS]
            lines.append(f"| {name} | {kind} kill | {len(faults)} | {_cell(stall)} | "
                         + " | ".join(parts) + " |")
    failed = [f"{r.launcher} run {r.index}: {r.error}" for r in runs if r.error]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(failed)]
    return "\n".join(lines)


def ratios(runs: list[Run], launchers: list[str]) -> str:
    """Median stall of each launcher against torchrun's, per fault."""
    out = []
    for kind in FAULTS:
        base = _median([r.faults[kind].stall for r in runs if r.launcher == "torchrun"
                        and kind in r.faults and r.faults[kind].stall is not None])
        for name in launchers:
            ours = _median([r.faults[kind].stall for r in runs if r.launcher == name
                            and kind in r.faults and r.faults[kind].stall is not None])
            if name != "torchrun" and base and ours:
                out.append(f"{kind} kill: {name} {ours:.2f} s, torchrun {base:.2f} s "
                           f"({base / ours:.1f}x)")
    return "\n".join(out)


def _start_etcd(workdir: Path) -> Any:
    from launch.etcd_server import EmbeddedEtcd

    server = EmbeddedEtcd(data_dir=str(workdir / "etcd"))
    server.start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--launchers", default="elastic-run,torchrun",
                        help="comma-separated: elastic-run, elastic-run-off, elastic-run-base, "
                        "torchrun")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a checkout whose launcher runs as elastic-run-base")
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--settle", type=float, default=6.0,
                        help="seconds of training before each fault")
    parser.add_argument("--hang-timeout", type=float, default=90.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep each run's files")
    args = parser.parse_args(argv)
    launchers = [x.strip() for x in args.launchers.split(",") if x.strip()]
    if "elastic-run-base" in launchers and args.baseline_tree is None:
        parser.error("elastic-run-base needs --baseline-tree DIR (a checkout to compare with)")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="restart-path-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        server = _start_etcd(workdir) if any(n.startswith("elastic") for n in launchers) \
            else None
        try:
            for index in range(args.runs):
                for name in launchers:
                    runs.append(one_run(name, index, workdir,
                                        server.endpoint if server else None,
                                        args.baseline_tree, args))
        finally:
            if server is not None:
                server.stop()
    print(f"Restart path, 3 nodes, examples/train_torchrun.py, step time {args.step_time} s, "
          f"{args.runs} run(s); medians in seconds; the parts are node 0's and add up to the "
          "stall.")
    if args.baseline_tree is not None and "elastic-run-base" in launchers:
        print(f"elastic-run-base: the launcher of {args.baseline_tree} (before).")
    if "elastic-run-off" in launchers:
        print("elastic-run-off: this tree with --warm-standby off --memory-checkpoints off.")
    loads = [f.load for r in runs for f in r.faults.values()]
    if loads:
        print(f"1-minute load average at the faults: {min(loads):g} to {max(loads):g} "
              f"({os.cpu_count()} CPUs).")
    print()
    print(table(runs, launchers))
    print()
    print(ratios(runs, launchers))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
