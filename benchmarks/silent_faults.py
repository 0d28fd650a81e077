"""Silent host loss and hung workers: the survivors' stall under elastic-run and torchrun.

Real hosts often die without a word (a spot VM reclaimed, a kernel panic, a switch port
dark): no reset, no answer. On 127.0.0.1 that cannot happen, so every run here builds a
cluster of network namespaces (``tests/support/netns.py``: 3 nodes, each with its own
address on one switch, and etcd in a namespace of its own), starts the same job on every
node with the flags a user passes, and breaks one node (``n2``, never the torchrun
rendezvous host) while the job trains:

* ``silent_host``: its link is cut on the switch (every frame dropped, both ways);
* ``sigstop``: its worker is SIGSTOPped (a frozen process);
* ``live_hang``: its worker stops before its step's collective while its threads run on
  (the hang file of ``tests/support/hang.py``: a deadlock, a stuck kernel, slow I/O).

Launchers (the job: ``tests/integration/training/inplace_worker.py``, float64, 0.05 s steps):

* ``elastic-run-inplace``: ``elastic-run --min-nodes 2 --max-nodes 3 --etcd ... --job-id ...``
  (the worker declares in place); the survivors abort the world when the lost member's key
  goes (its lease TTL, ``--inplace-ttl`` 3 s), a stopped worker is replaced once silent for
  0.6 s (its kernel state says stopped), a live-hung one is evicted by the progress rule
  (``--hang-timeout`` 10 s);
* ``elastic-run-restart``: the same with ``--elastic-mode restart`` (every change restarts
  every worker from the last checkpoint);
* ``torchrun``: ``--nnodes 2:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d``,
  hosted by ``n0`` (plus what such hosts need: ``is_host=1`` on ``n0``, ``--local-addr``,
  ``GLOO_SOCKET_IFNAME``).

The stall is the time from the fault until training went on without the lost worker, read
from the workers' own step timestamps (``tests.support.netns_job.stall``): in place, until
every survivor completed a step in a newer world; under the restarting launchers, until the
first step of a new worker process or a newer world. A run that has not recovered ``--cap``
seconds after the fault is capped and reported as "> cap" (its median too, when at least
half the runs were capped). Goals: in place, a silent host costs at most the TTL + 1 s (4 s,
issue 14), a SIGSTOP at most 1.5 s (issue 25), a live hang at most the progress rule's bound
+ 1 s (11 s).

Needs root, ``ip`` and ``nft`` (Debian's iproute2 and nftables); elsewhere it prints one line
saying why and exits 0 with ``{"skipped": reason}`` as its JSON. Prints one Markdown table;
``--json`` writes every run.

Usage::

    sudo python benchmarks/silent_faults.py [--runs 5] [--cap 120] [--json out.json]

About an hour on 2 cores with the defaults (torchrun's runs mostly wait out the cap);
``--runs 1 --cap 60`` takes about ten minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # tests.support: the namespace cluster and the job harness

LAUNCHERS = ("elastic-run-inplace", "elastic-run-restart", "torchrun")
SCENARIOS = ("silent_host", "sigstop", "live_hang")
SCENARIO_LABELS = {"silent_host": "silent host loss (link cut)",
                   "sigstop": "hung worker (SIGSTOP)",
                   "live_hang": "hung worker (live, before its collective)"}
#: elastic-run's defaults the goals are stated in.
INPLACE_TTL_S = 3.0
HANG_TIMEOUT_S = 10.0
#: A frozen worker is replaced once it is silent and the kernel reports it stopped (issue 25:
#: at most 1.5 s, against 2.96 s when it waited for the lease TTL; TorchFT 0.2.0, lighthouse
#: heartbeat timeout 1 s: 1.09 s as measured for the issue).
FROZEN_GOAL_S = 1.5
GOALS = {"silent_host": INPLACE_TTL_S + 1.0, "sigstop": FROZEN_GOAL_S,
         "live_hang": HANG_TIMEOUT_S + 1.0}
STEP_TIME_S = 0.05
WARM_UP = 8
AHEAD = 20  # steps trained in the full world before the fault
INTERVAL = 50  # steps between checkpoints
JOB_STEPS = 1_000_000  # never reached: each run is stopped once its stall is measured
TORCHRUN_FLAGS = ("--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3")
ELASTIC_FLAGS = ("--min-nodes", "2", "--max-nodes", "3")


@dataclass
class Run:
    """One measured run.

    Attributes:
        launcher: One of :data:`LAUNCHERS`.
        scenario: One of :data:`SCENARIOS`.
        index: The run's number (0-based) for this launcher and scenario.
        stall_s: The survivors' stall in seconds; ``None`` if the run was capped or failed.
        capped: Whether it had not recovered ``cap_s`` seconds after the fault.
        cap_s: The cap.
        error: Why the run gave no figure (start-up failed, ...), else empty.
    """

    launcher: str
    scenario: str
    index: int
    stall_s: float | None
    capped: bool
    cap_s: float
    error: str = ""


# --------------------------------------------------------------------------------------------
# One run


def _start(job: Any, launcher: str, timeout_s: float) -> list[Any]:
    """Starts the job on every node and returns once it trained past ``WARM_UP`` together."""
    cluster = job.cluster
    if launcher == "torchrun":
        job.open_gate(0)
        launchers = [job.torchrun(host, *TORCHRUN_FLAGS, rdzv_host=cluster.nodes[0])
                     for host in cluster.nodes]
        n = len(cluster.nodes)
        job.wait_for(lambda a: (g := job.newest_gen(a)) >= 0 and a.world_of(g) == n
                     and len(a.pids_by_gen()[g]) == n, f"a world of {n}", timeout_s)
        job.open_gate(WARM_UP + 1)
        job.wait_for(lambda a: job.latest_step(a) >= WARM_UP, f"step {WARM_UP}", timeout_s)
        return launchers
    flags = ELASTIC_FLAGS if launcher == "elastic-run-inplace" else (
        *ELASTIC_FLAGS, "--elastic-mode", "restart")
    started: list[Any] = job.start_together(flags, warm_up=WARM_UP, timeout_s=timeout_s)
    return started


def _worker_of(launcher: Any) -> int:
    pid: int = launcher.worker()
    return pid


def _action(scenario: str, job: Any, victim: Any,
            agent: Any) -> tuple[Callable[[], None], list[int] | None]:
    """The fault's action and the worker PIDs it hits (``None``: every worker of the node)."""
    cluster = job.cluster
    if scenario == "silent_host":
        return (lambda: cluster.cut_link(victim)), None
    pid = _worker_of(agent)
    if scenario == "sigstop":

        def stop_it() -> None:
            cluster.sigstop(pid)

        return stop_it, [pid]

    def hang_it() -> None:
        cluster.hang_worker(pid)
        cluster.wait_hung(pid, 30.0)

    return hang_it, [pid]


def one_run(launcher: str, scenario: str, index: int, root: Path, cap_s: float) -> Run:
    """Builds a cluster, runs the job, injects the fault, measures the stall, cleans up."""
    from tests.support import hang
    from tests.support.netns import NetnsCluster
    from tests.support.netns_job import NetnsJob, inplace_worker_args, stall

    run = Run(launcher, scenario, index, None, False, cap_s)
    work = root / f"{launcher}-{scenario}-{index}"
    with NetnsCluster(nodes=3, etcd_members=1) as cluster:
        job = NetnsJob(cluster, work, inplace_worker_args(work, steps=JOB_STEPS,
                                                          step_time=STEP_TIME_S,
                                                          interval=INTERVAL),
                       job_id=f"silent-{uuid.uuid4().hex[:8]}")
        try:
            try:
                _start(job, launcher, timeout_s=180.0)
            except AssertionError as exc:
                run.error = f"start-up failed: {str(exc).splitlines()[0]}"
                return run
            job.open_gate(JOB_STEPS)
            before = job.latest_step(job.audit())
            job.wait_for(lambda a: job.latest_step(a) >= before + AHEAD,
                         f"{AHEAD} steps in the full world", 120.0)
            victim = cluster.nodes[2]
            (agent,) = job.on(victim)
            action, hit = _action(scenario, job, victim, agent)
            fault = job.fault(scenario, victim, action, hit=hit)
            restarted = launcher != "elastic-run-inplace"
            while True:
                measured = stall(job.audit(), fault, restarted=restarted)
                if math.isfinite(measured):
                    run.stall_s = round(measured, 3)
                    break
                if time.time() - fault.t > cap_s:
                    run.capped = True
                    break
                if job.all_exited():
                    run.error = "every launcher exited before training went on"
                    break
                time.sleep(0.5)
            if run.stall_s is not None and run.stall_s > cap_s:
                run.stall_s, run.capped = None, True
        finally:
            hang.release_all(cluster.hang_file)
            job.stop()
    return run


# --------------------------------------------------------------------------------------------
# The table


def summarize(runs: Sequence[Run]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (launcher, scenario): the median stall (a capped run counts as longer than any
    measured one), the runs, how many were capped or failed."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for launcher in LAUNCHERS:
        for scenario in SCENARIOS:
            mine = [r for r in runs if r.launcher == launcher and r.scenario == scenario]
            if not mine:
                continue
            valid = [r for r in mine if not r.error]
            values = sorted((math.inf if r.capped else float(r.stall_s or 0.0)) for r in valid)
            median = statistics.median(values) if values else None
            out[(launcher, scenario)] = {
                "median_s": None if median is None or math.isinf(median) else median,
                "over_cap": median is not None and math.isinf(median),
                "cap_s": mine[0].cap_s, "runs": len(mine),
                "capped": sum(r.capped for r in mine),
                "failed": sum(bool(r.error) for r in mine),
                "values": [None if r.capped or r.error else r.stall_s for r in mine],
            }
    return out


def _fmt(entry: dict[str, Any]) -> str:
    if entry["over_cap"]:
        return f"> {entry['cap_s']:g} s"
    if entry["median_s"] is None:
        return "failed"
    return f"{entry['median_s']:.2f} s"


def _run_text(run: Run) -> str:
    if run.error:
        return "failed"
    return "> cap" if run.capped or run.stall_s is None else f"{run.stall_s:.2f}"


def table(runs: Sequence[Run], cap_s: float) -> str:
    """The Markdown table of the medians, with every run's value and the goals."""
    summary = summarize(runs)
    lines = [
        f"Survivors' stall after a silent fault on one of 3 nodes (network namespaces, CPU, "
        f"gloo, {STEP_TIME_S:g} s steps); medians, each run capped at {cap_s:g} s "
        "(\"> cap\": not recovered by then):",
        "",
        "| fault | launcher | stall, median | runs (s) | goal (in place) | met? |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for scenario in SCENARIOS:
        for launcher in LAUNCHERS:
            entry = summary.get((launcher, scenario))
            if entry is None:
                continue
            values = ", ".join(_run_text(r) for r in runs
                               if r.launcher == launcher and r.scenario == scenario)
            goal, met = "-", "-"
            if launcher == "elastic-run-inplace":
                goal = f"<= {GOALS[scenario]:g} s"
                med = entry["median_s"]
                met = "n/a" if med is None and not entry["over_cap"] else (
                    "yes" if med is not None and med <= GOALS[scenario] else "**no**")
            lines.append(f"| {SCENARIO_LABELS[scenario]} | {launcher} | {_fmt(entry)} | "
                         f"{values} | {goal} | {met} |")
    lines += ["", "In place: until every survivor completed a step in the next world; restart "
              "mode and torchrun: until the first step of a new worker process (or a newer "
              "world). Goals: TTL + 1 s for a silent host, 1.5 s for a SIGSTOP, the progress "
              f"rule's bound ({HANG_TIMEOUT_S:g} s) + 1 s for a live hang."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per launcher and fault")
    parser.add_argument("--cap", type=float, default=120.0,
                        help="seconds after the fault before a run counts as '> cap'")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help=f"comma-separated, of {', '.join(LAUNCHERS)}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    launchers = [x for x in args.launchers.split(",") if x]
    scenarios = [x for x in args.scenarios.split(",") if x]
    bad = [x for x in launchers if x not in LAUNCHERS] + [
        x for x in scenarios if x not in SCENARIOS]
    if bad or args.runs < 1 or args.cap <= 0:
        parser.error(f"unknown launcher or fault {bad}, or --runs ({args.runs}) below 1, or "
                     f"--cap ({args.cap}) not positive.")
    from tests.support.netns import netns_unavailable

    reason = netns_unavailable()
    if reason is not None:
        message = f"silent_faults: skipped: it runs on network namespaces, and {reason}"
        print(message, file=sys.stderr)
        if args.json is not None:
            args.json.write_text(json.dumps({"skipped": reason}))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="silent-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"work directory {root}; load average {os.getloadavg()[0]:.1f}", file=sys.stderr,
          flush=True)
    runs: list[Run] = []
    # Interleaved (run i of every launcher and fault, then run i + 1) so that a slow period
    # of a shared machine does not fall on one launcher alone.
    for index in range(args.runs):
        for scenario in scenarios:
            for launcher in launchers:
                began = time.monotonic()
                run = one_run(launcher, scenario, index, root, args.cap)
                runs.append(run)
                print(f"{launcher} {scenario} #{index}: stall "
                      f"{'> cap' if run.capped else run.stall_s} {run.error} "
                      f"({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
                if args.json is not None:
                    args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    print(table(runs, args.cap))
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    with contextlib.suppress(OSError):
        if args.json is not None:
            args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
