"""Goodput under a fault every 30 s: elastic-run (its own report and a stopwatch) vs torchrun.

Three agents on 127.0.0.1 (``--nnodes 2:3 --nproc-per-node 1``, gloo, CPU) train the same job:
an MLP through ``ElasticLoop`` + ``ElasticSampler`` + ``CheckpointManager`` (local disk, a
checkpoint every ``--interval`` steps), each step padded to ``--step-time`` seconds so that the
job is compute-bound the same way under both launchers. Every ``--period`` seconds one node's
whole process tree is SIGKILLed and a fresh agent takes its slot ``--rejoin`` seconds later (a
node lost, then a node joining: two membership changes per fault). After ``--duration``
seconds every agent gets SIGTERM (the workers drain) and the run ends when all have exited.

Goodput, two ways:

* **stopwatch** (external, both launchers): ``productive steps * undisturbed step time /
  wall``, where productive steps is the step count of the surviving history at the end (steps
  redone after a rollback count once), the undisturbed step time is measured in a fault-free
  run of the same job under the same launcher, and wall is from the first agent's launch to the
  last agent's exit;
* **reported** (elastic-run only): ``elastic-run goodput EVENTS_DIR --json`` of the run.

elastic-run runs in both of its modes: ``--elastic-mode inplace`` (survivors keep training,
a new node's worker is healed from a survivor) and the restart mode (every membership change
restarts all workers from the last checkpoint).

torchrun runs torch's c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it
restarts hang, pytorch#135712) and the same short rendezvous timeouts. Its c10d store lives in
the first agent, whose loss ends the job, so faults hit the other two slots only, under both
launchers (the same schedule). Prints one Markdown table; ``--json`` writes the numbers.

``--fault silent-host`` runs the same job on a cluster of network namespaces instead
(``tests/support/netns.py``: each node in a namespace of its own with its own address, etcd
in another) and, every ``--period`` seconds, cuts a node's link on the switch for good (a
host that dies without a word: no reset, no answer), then starts a replacement node in a
fresh namespace ``--rejoin`` seconds later (the dark host's processes are killed then,
unseen, as a reclaimed VM's would be). torchrun there needs ``is_host=1`` on the rendezvous
host, ``--local-addr`` and ``GLOO_SOCKET_IFNAME``; elastic-run needs nothing more. Its goal
(issue 14): goodput >= 0.90 in place. It needs root, ``ip`` and ``nft``; elsewhere it prints
one line saying why and exits 0 with ``{"skipped": reason}`` as its JSON.

``--script example`` runs ``examples/train.py`` as shipped instead (float64, a checkpoint every
``--interval`` steps, each step padded to ``--step-time``), under elastic-run with the flags a
user passes (``--min-nodes 2 --max-nodes 3 --etcd ... --job-id ...``: in place because the
script uses ``ElasticLoop``) and under torchrun (which restarts it on every change); the
stopwatch then reads the steps from the job's event log, which the loop writes itself under
torchrun.

Usage::

    python benchmarks/goodput_under_faults.py [--duration 300] [--period 30] [--json out.json]
    python benchmarks/goodput_under_faults.py --script example --launchers elastic-run,torchrun
    sudo python benchmarks/goodput_under_faults.py --fault silent-host \
        --launchers elastic-run-inplace,torchrun [--duration 300] [--json out.json]

The duration is 5 minutes by default: start-up and shut-down (importing torch in every agent and
worker, the first rendezvous) cost the same few seconds to every launcher, and a training job
runs for hours, so a short run would mostly measure those.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"
NODES = 3
FAST_RDZV_CONF = ("join_timeout=90,last_call_timeout=1,close_timeout=10,heartbeat_timeout=5,"
                  "keep_alive_interval=1,keep_alive_max_attempt=3")


# --------------------------------------------------------------------------------------------
# The worker (this file with --worker, under either launcher)


def worker_main(args: argparse.Namespace) -> int:
    """Train until drained (SIGTERM) or ``--steps``; rank 0 logs ``time step world``."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import elastic
    from checkpointing import CheckpointManager, ModelOptimizerState

    # GOODPUT_WORKER_LOG=INFO shows where a reconfiguration's time goes (agent*.log).
    logging.basicConfig(level=os.environ.get("GOODPUT_WORKER_LOG", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    ctx = elastic.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 32, generator=generator)
    dataset = TensorDataset(x, x.sum(1, keepdim=True))
    sampler = elastic.ElasticSampler(len(dataset), seed=3)
    manager = CheckpointManager(args.ckpt, process_group=ctx.checkpoint_group, round=ctx.round)
    progress = Path(args.progress)
    # Written for both modes: in place (elastic-run --elastic-mode inplace) the step body runs
    # in loop.step_guard(), DDP comes from loop.data_parallel() and the loader's batch
    # sampler follows every world (48 samples split unevenly over 2 ranks); in restart mode
    # those are no-ops.
    loader: DataLoader[Any] | None = None
    with elastic.ElasticLoop(ctx, state={"train": ModelOptimizerState(model, optimizer)},
                             checkpoint=manager, sampler=sampler, max_steps=args.steps,
                             checkpoint_interval=args.interval, global_batch_size=48,
                             micro_batch_size=16) as loop:
        for step in loop:
            began = time.monotonic()
            with loop.step_guard():
                if loader is None:  # one loader: its batch sampler follows every world
                    loader = DataLoader(dataset, batch_sampler=loop.batch_sampler())
                ddp = loop.data_parallel(model)
                for xb, yb in loop.micro_batches(loader, ddp):
                    loop.scale_loss(nn.functional.mse_loss(ddp(xb), yb)).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                # Pad the step to a fixed compute time (the same job under every launcher).
                time.sleep(max(0.0, args.step_time - (time.monotonic() - began)))
                loop.end_step()
            if ctx.rank == 0 and loop.step > step:
                with progress.open("a") as f:
                    f.write(f"{time.time():.3f} {step} {ctx.world_size}\n")
    return 0


# --------------------------------------------------------------------------------------------
# The driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        kids = []
    for kid in kids:
        out.extend(_tree(kid))
    return out


def _kill_tree(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    for pid in _tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class Run:
    launcher: str
    faults: int
    wall_s: float
    steps: int
    step_time_s: float
    stopwatch_goodput: float
    training_s: float = 0.0
    stopwatch_training_goodput: float = 0.0
    reported_goodput: float | None = None
    reported_training_goodput: float | None = None
    reported: dict[str, Any] | None = None


class Job:
    """One job of 3 agents under one launcher, with the fault schedule."""

    def __init__(self, launcher: str, root: Path, args: argparse.Namespace,
                 etcd: str | None) -> None:
        self.launcher = launcher
        self.root = root
        self.args = args
        self.etcd = etcd
        self.port = _free_port()
        self.job_id = f"goodput-{launcher}-{os.getpid()}-{int(time.time())}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.slots: list[subprocess.Popen[bytes] | None] = [None] * NODES
        self.env = dict(os.environ, OMP_NUM_THREADS="1",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                 os.environ.get("PYTHONPATH")])),
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        if self.example:  # the loop writes the job's steps there itself under torchrun
            self.env["ELASTIC_EVENTS_DIR"] = str(root / "events")

    @property
    def example(self) -> bool:
        """Whether the job is ``examples/train.py`` as shipped (``--script example``)."""
        return bool(getattr(self.args, "script", "bench") == "example")

    def _argv(self, steps: int) -> list[str]:
        worker = [str(Path(__file__).resolve()), "--worker", "--ckpt", str(self.root / "ckpt"),
                  "--progress", str(self.root / "progress.txt"), "--steps", str(steps),
                  "--interval", str(self.args.interval), "--step-time",
                  str(self.args.step_time)]
        common = ["--nnodes", f"2:{NODES}", "--nproc-per-node", "1", "--max-restarts", "100",
                  "--rdzv-conf", FAST_RDZV_CONF, "--monitor-interval", "0.1"]
        if self.example:
            # The README's example with script arguments only; elastic-run with the flags a
            # user passes (node counts, etcd, job id) and the event log the report reads.
            worker = [str(EXAMPLE), "--steps", str(steps), "--step-time",
                      str(self.args.step_time), "--checkpoint-dir", str(self.root / "ckpt"),
                      "--checkpoint-every", str(self.args.interval), "--dtype", "float64"]
            if self.launcher != "torchrun":
                assert self.etcd is not None
                return [sys.executable, "-m", "launch", "--min-nodes", "2", "--max-nodes",
                        str(NODES), "--etcd", self.etcd, "--job-id", self.job_id,
                        "--events-dir", str(self.root / "events"), *self.args.elastic_run_arg,
                        *worker]
        if self.launcher == "elastic-run-inplace":
            common = [*common, "--elastic-mode", "inplace"]
        if self.launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", *common,
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                    "--rdzv-id", self.job_id, *worker]
        assert self.etcd is not None
        return [sys.executable, "-m", "launch", *common, "--etcd", self.etcd,
                "--job-id", self.job_id, "--events-dir", str(self.root / "events"),
                *self.args.elastic_run_arg, *worker]

    def start(self, slot: int, steps: int) -> None:
        log = open(self.root / f"agent{len(self.procs)}.log", "wb")  # noqa: SIM115 - kept open
        proc = subprocess.Popen(self._argv(steps), stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=REPO, start_new_session=True)
        self.procs.append(proc)
        self.slots[slot] = proc

    def inject(self, slot: int, steps: int) -> None:
        """One fault: the slot's node loses its whole process tree; a new one takes the slot
        ``--rejoin`` seconds later."""
        victim = self.slots[slot]
        assert victim is not None
        _kill_tree(victim)
        victim.wait()
        time.sleep(self.args.rejoin)
        self.start(slot, steps)

    def progress(self) -> list[tuple[float, int, int]]:
        if self.example:
            return self._logged_steps()
        path = self.root / "progress.txt"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
        return rows

    def _logged_steps(self) -> list[tuple[float, int, int]]:
        """``(time, step, world)`` of every step in the job's event log (global rank 0's,
        under either launcher: the loop writes them itself under torchrun)."""
        from elastic.eventlog import read_events

        events = self.root / "events"
        if not events.exists():
            return []
        return [(float(e["time"]), int(e["step"]), int(e.get("world", 0)))
                for e in read_events(events) if e.get("event") == "step" and "step" in e]

    def run(self, duration: float, faults: bool, steps: int = 1_000_000) -> tuple[float, int]:
        """Runs the job for ``duration`` s (with the schedule), drains it; ``(wall, steps)``."""
        self.root.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        for slot in range(NODES):
            self.start(slot, steps)
            if slot == 0 and self.launcher == "torchrun":
                time.sleep(1.0)  # the c10d store host first, as a user would start it
        # The schedule counts from the first step, so that start-up costs the same to both.
        while not self.progress():
            if time.monotonic() - start > 120:
                raise RuntimeError(f"{self.launcher}: no step after 120 s; see {self.root}")
            time.sleep(0.1)
        first = time.monotonic()
        fault_at = first + self.args.period
        count = 0
        while time.monotonic() - first < duration:
            if faults and time.monotonic() >= fault_at:
                slot = 1 + count % (NODES - 1)  # never the c10d store host (slot 0)
                self.inject(slot, steps)
                count += 1
                fault_at += self.args.period
            time.sleep(0.05)
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_tree(proc)
        wall = time.monotonic() - start
        for proc in self.procs:
            _kill_tree(proc)
        rows = self.progress()
        last = max(rows, key=lambda r: r[0]) if rows else (0.0, -1, 0)
        self.faults = count
        # First logged step to the last one (start-up and shut-down excluded).
        self.training_s = (last[0] - min(r[0] for r in rows)) if rows else 0.0
        return wall, last[1] + 1


class NetnsJob(Job):
    """The same job on a cluster of network namespaces, losing silent hosts (see the module
    docstring). ``NODES`` namespaces start the job; one spare per fault takes a lost slot."""

    def __init__(self, launcher: str, root: Path, args: argparse.Namespace,
                 faults: int) -> None:
        from tests.support.netns import NetnsCluster

        self.cluster = NetnsCluster(nodes=NODES + faults, etcd_members=1).start()
        super().__init__(launcher, root, args, self.cluster.etcd_endpoints)
        self.hosts = list(self.cluster.nodes[:NODES])
        self.spares = list(self.cluster.nodes[NODES:])
        self.env.pop("GLOO_SOCKET_IFNAME", None)  # elastic-run finds its interface itself

    def _argv(self, steps: int, slot: int = 0) -> list[str]:
        argv = super()._argv(steps)
        if self.launcher != "torchrun":
            return argv
        # torchrun on such hosts: the rendezvous host's address, is_host=1 there (it cannot
        # recognise itself), and the node's own address to advertise.
        host, rdzv = self.hosts[slot], self.hosts[0]
        at = argv.index("--rdzv-endpoint")
        argv[at + 1] = f"{rdzv.address}:29400"
        conf = argv.index("--rdzv-conf")
        argv[conf + 1] += ",is_host=1" if host is rdzv else ""
        return [*argv[:at], "--local-addr", host.address, *argv[at:]]

    def start(self, slot: int, steps: int) -> None:
        host = self.hosts[slot]
        env = dict(self.env)
        if self.launcher == "torchrun":
            env["GLOO_SOCKET_IFNAME"] = host.ifname
        log = open(self.root / f"agent{len(self.procs)}.log", "wb")  # noqa: SIM115 - kept open
        proc = host.popen(self._argv(steps, slot), env=env, cwd=REPO, stdout=log,
                          stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.slots[slot] = proc

    def inject(self, slot: int, steps: int) -> None:
        """One fault: the slot's host goes silent for good; a replacement node starts in a
        fresh namespace ``--rejoin`` seconds later, and the dark host's processes are killed
        (nobody can see it: every frame to or from it is dropped)."""
        lost = self.hosts[slot]
        self.cluster.cut_link(lost)
        time.sleep(self.args.rejoin)
        self.hosts[slot] = self.spares.pop(0)
        self.start(slot, steps)
        lost.kill_all()

    def run(self, duration: float, faults: bool, steps: int = 1_000_000) -> tuple[float, int]:
        try:
            return super().run(duration, faults, steps)
        finally:
            self.cluster.close()


def _reported(events: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "launch.goodput", str(events), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    (report,) = json.loads(done.stdout)
    return dict(report)


def measure(launcher: str, root: Path, args: argparse.Namespace, etcd: str | None) -> Run:
    # Undisturbed step time of this launcher: a fault-free run of the same job.
    silent = args.fault == "silent-host"
    calm = NetnsJob(launcher, root / f"{launcher}-calm", args, 0) if silent \
        else Job(launcher, root / f"{launcher}-calm", args, etcd)
    calm.run(args.calm, faults=False)
    rows = calm.progress()
    times = sorted(t for t, _, _ in rows)
    step_time = (times[-1] - times[len(times) // 5]) / max(1, len(times) - 1 - len(times) // 5)
    faults = int(args.duration // args.period) + 1
    job = NetnsJob(launcher, root / launcher, args, faults) if silent \
        else Job(launcher, root / launcher, args, etcd)
    wall, steps = job.run(args.duration, faults=True)
    training = job.training_s + step_time  # the first step's own time too
    result = Run(launcher=launcher, faults=job.faults, wall_s=round(wall, 1), steps=steps,
                 step_time_s=round(step_time, 4),
                 stopwatch_goodput=round(steps * step_time / wall, 3),
                 training_s=round(training, 1),
                 stopwatch_training_goodput=round(steps * step_time / training, 3))
    if launcher.startswith("elastic-run"):
        report = _reported(job.root / "events")
        result.reported = {k: report[k] for k in ("wall_s", "productive_s", "goodput",
                                                  "training_s", "training_goodput",
                                                  "breakdown", "recomputed_steps")}
        result.reported["changes"] = [
            {k: c[k] for k in ("reason", "recovery_s", "detection_s", "rendezvous_s",
                               "restore_s")} for c in report["changes"]]
        result.reported_goodput = None if report["goodput"] is None else round(
            float(report["goodput"]), 3)
        result.reported_training_goodput = None if report["training_goodput"] is None \
            else round(float(report["training_goodput"]), 3)
    print(f"{launcher}: {asdict(result)}", file=sys.stderr, flush=True)
    return result


def table(runs: list[Run], args: argparse.Namespace) -> str:
    fault = (f"a silent host loss every {args.period:g} s (a node's link cut for good, on a "
             f"cluster of network namespaces), a replacement node {args.rejoin:g} s later"
             if args.fault == "silent-host" else
             f"a node killed every {args.period:g} s and replaced {args.rejoin:g} s later")
    lines = [
        f"Goodput, 3 nodes (CPU, gloo), {fault}, {args.duration:g} s of training after the "
        f"first step, step {args.step_time:g} s, checkpoint every {args.interval} steps:",
        "",
        "| launcher | faults | wall s | steps | undisturbed step s | goodput, stopwatch "
        "| goodput, elastic-run report | training goodput, stopwatch | training goodput, "
        "report |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        reported = "-" if r.reported_goodput is None else f"{r.reported_goodput:.3f}"
        training = "-" if r.reported_training_goodput is None \
            else f"{r.reported_training_goodput:.3f}"
        lines.append(f"| {r.launcher} | {r.faults} | {r.wall_s:.1f} | {r.steps} | "
                     f"{r.step_time_s:.3f} | {r.stopwatch_goodput:.3f} | {reported} | "
                     f"{r.stopwatch_training_goodput:.3f} | {training} |")
    lines += ["", "goodput: productive time over wall time (launch of the first agent to the "
              "exit of the last); training goodput: over the time from the first step to the "
              "last (start-up and shut-down excluded: what a long job converges to)."]
    for r in runs:
        if r.reported:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r.reported["breakdown"].items())
            lines += ["", f"{r.launcher}: its own split of the wall time (s): {parts}."]
            recov = [f"{c['reason']} {c['recovery_s']:.1f}" for c in r.reported["changes"]]
            if recov:
                lines.append(f"Recovery per membership change (s): {', '.join(recov)}.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1_000_000, help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds per step")
    parser.add_argument("--duration", type=float, default=300.0,
                        help="seconds of training under faults, per launcher")
    parser.add_argument("--calm", type=float, default=20.0,
                        help="seconds of the fault-free run that measures the step time")
    parser.add_argument("--period", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--rejoin", type=float, default=5.0,
                        help="seconds until the killed node's replacement starts")
    parser.add_argument("--launchers", default="elastic-run-inplace,elastic-run,torchrun",
                        help="comma-separated: elastic-run-inplace (--elastic-mode inplace), "
                             "elastic-run (restart mode), torchrun")
    parser.add_argument("--elastic-run-arg", action="append", default=[],
                        help="extra elastic-run flag (repeat), e.g. --elastic-run-arg=--x")
    parser.add_argument("--fault", choices=("node-kill", "silent-host"), default="node-kill",
                        help="node-kill: a node's process tree SIGKILLed on 127.0.0.1 "
                        "(default); silent-host: a node's link cut for good on a cluster of "
                        "network namespaces (needs root)")
    parser.add_argument("--script", choices=("bench", "example"), default="bench",
                        help="bench: this file's worker (default); example: examples/train.py "
                        "as shipped (float64), elastic-run with default flags, goodput from "
                        "the steps in the job's event log")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    root = Path(tempfile.mkdtemp(prefix="goodput-bench-"))
    runs = []
    if args.fault == "silent-host":
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))  # tests.support: the namespace cluster
        from tests.support.netns import netns_unavailable

        reason = netns_unavailable()
        if reason is not None:
            print(f"goodput_under_faults: skipped: --fault silent-host runs on network "
                  f"namespaces, and {reason}", file=sys.stderr)
            if args.json is not None:
                args.json.write_text(json.dumps({"skipped": reason}))
            return 0
        print(f"work directory {root}", file=sys.stderr, flush=True)
        for launcher in args.launchers.split(","):
            runs.append(measure(launcher, root, args, None))
    else:
        from launch.etcd_server import EmbeddedEtcd

        print(f"work directory {root}", file=sys.stderr, flush=True)
        with EmbeddedEtcd() as etcd:
            for launcher in args.launchers.split(","):
                runs.append(measure(launcher, root, args, etcd.endpoint))
    text = table(runs, args)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
