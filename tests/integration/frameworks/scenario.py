"""The framework integrations' acceptance scenario: a 3-node job under real ``elastic-run``
agents and a real etcd, through a worker SIGKILL, a spot preemption notice (a fake AWS IMDS)
and a node's process tree SIGKILL, compared with an undisturbed one-process run.

The job script (``lightning_job.py`` or ``hf_job.py``) logs, per round (``ELASTIC_ROUND``)
and rank, where it resumed and the sample ids of every step; a gate file holds each world at
a step the test chooses, so every fault lands at a known step whatever the machine's load:

1. worlds of 3 (the first may be smaller while nodes arrive: it then grows, a drain the agents
   ask for); a worker of node 1 is SIGKILLed: every worker restarts;
2. node 2's cloud announces its preemption: every rank drains at an agreed step with a final
   checkpoint, node 2's agent exits 0, nodes 0 and 1 restart in a world of 2;
3. node 1's agent and worker are SIGKILLed: node 0 restarts alone and trains to the end.

Checked: every world after a fault resumes from the newest committed checkpoint at its
start; the drain's checkpoint is committed and is where the next world resumes; every step's
global batch was trained exactly once (its last execution); the final float64 weights equal
the undisturbed run's; ``elastic-run goodput`` counts every step; the node's metrics saw the
steps and the commits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastic.eventlog import read_events
from tests.integration.launcher_scripts.harness import (
    REPO,
    Agent,
    Cluster,
    cluster,
    wait_until,
)
from tests.unit.launch.test_preemption_fakes import serve

STEPS = 60
EVERY = 5
GLOBAL_BATCH = 10  # 3 ranks split it 4-3-3: the uneven shares the loss scaling must fix
DATASET = 64  # steps straddle epochs: 10 does not divide 64
WAIT_S = 240.0  # a hang guard for a busy 2-core host, never a timing claim
#: Agents notice a lost node within the lease TTL; the rest is tuned for a fast suite only.
RDZV_CONF = "join_timeout=120,last_call_timeout=1"


@dataclass
class Round:
    """One world's workers, from their audit logs."""

    round: int
    world: int
    resumed: int = -1
    pids: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    #: step -> the ranks that completed it, and the ids each trained
    steps: dict[int, dict[int, list[int]]] = field(default_factory=lambda: defaultdict(dict))
    #: step count -> the ranks held at the gate before running it
    held: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))

    def completed(self, step: int) -> bool:
        """Whether every rank of the world completed ``step``."""
        return len(self.steps.get(step, {})) == self.world


def read_rounds(audit: Path) -> dict[int, Round]:
    """Every round whose workers all wrote their resume line."""
    rounds: dict[int, Round] = {}
    for path in sorted(audit.glob("round*.rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # being written
            r = rounds.setdefault(int(record["round"]), Round(int(record["round"]),
                                                              int(record["world"])))
            if "resumed" in record:
                r.resumed = int(record["resumed"])
                r.pids.add(int(record["pid"]))
                r.ranks.add(int(record["rank"]))
            elif "held" in record:
                r.held[int(record["held"])].add(int(record["rank"]))
            else:
                r.steps[int(record["step"])][int(record["rank"])] = list(record["ids"])
    return {k: r for k, r in rounds.items() if len(r.ranks) == r.world}


def committed_steps(ckpt: Path) -> dict[int, dict[str, Any]]:
    """Step -> commit marker of every committed checkpoint (the integrations keep them all)."""
    out = {}
    for marker in (ckpt / ".elastic-commits").glob("*.json"):
        record = json.loads(marker.read_text())
        out[int(record["step"])] = record
    return out


def final_ids(rounds: dict[int, Round]) -> dict[int, list[int]]:
    """Per step, the ids its last complete execution trained (earlier ones were rolled back)."""
    out: dict[int, list[int]] = {}
    for number in sorted(rounds):
        r = rounds[number]
        for step in r.steps:
            if r.completed(step):
                out[step] = sorted(i for ids in r.steps[step].values() for i in ids)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outcome:
    """What the scenario saw, for the framework tests' assertions and report."""

    rounds: dict[int, Round]
    restores: list[tuple[str, Round, int]]  # (fault, the world after it, newest committed)
    drained_at: int
    committed: dict[int, dict[str, Any]]
    weights: dict[str, torch.Tensor]
    reference: dict[str, torch.Tensor]
    reference_ids: dict[int, list[int]]
    goodput: dict[str, Any]
    metrics: str
    codes: dict[str, int | None]
    wall_s: float
    events: list[dict[str, Any]]


class Scenario:
    """The scenario for one job script (see the module docstring).

    Args:
        script: The job script.
        tmp: The test's directory.
        endpoint: The etcd endpoint.
        extra: Script arguments of the framework (its micro-batching).
    """

    def __init__(self, script: Path, tmp: Path, endpoint: str, extra: Sequence[str]) -> None:
        self.script, self.tmp, self.endpoint, self.extra = script, tmp, endpoint, list(extra)
        self.ckpt = tmp / "ckpt"
        self.audit = tmp / "audit"
        self.events = tmp / "events"
        self.gate = tmp / "gate"
        self.weights = tmp / "weights.pt"

    def script_args(self, ckpt: Path, audit: Path, weights: Path, gate: str) -> list[str]:
        return [str(self.script), "--checkpoint-dir", str(ckpt), "--audit-dir", str(audit),
                "--steps", str(STEPS), "--every", str(EVERY), "--global-batch",
                str(GLOBAL_BATCH), "--dataset-size", str(DATASET), "--weights-out",
                str(weights), "--gate-file", gate, *self.extra]

    def start_reference(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Starts the undisturbed run (one process, no launcher) beside the job: it is done
        long before the job, whose workers spend most of the time starting."""
        root = self.tmp / "reference"
        args = self.script_args(root / "ckpt", root / "audit", root / "weights.pt", "")
        log = (self.tmp / "reference.log").open("wb")
        try:
            return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def reference(self, proc: subprocess.Popen[bytes]) -> tuple[dict[str, torch.Tensor],
                                                                 dict[int, list[int]]]:
        """The undisturbed run's final weights and the ids of each step."""
        try:
            code = proc.wait(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        root = self.tmp / "reference"
        assert code == 0, (self.tmp / "reference.log").read_text()[-3000:]
        return (torch.load(root / "weights.pt", weights_only=True),
                final_ids(read_rounds(root / "audit")))

    def open_gate(self, below: int) -> None:
        """Lets the workers run the steps below ``below``."""
        tmp = self.gate.with_suffix(".tmp")
        tmp.write_text(str(below))
        tmp.replace(self.gate)

    def run(self) -> Outcome:
        started = time.monotonic()
        with serve("aws") as (aws_url, aws), cluster(
                self.tmp, self.endpoint, f"fw-{uuid.uuid4().hex[:8]}") as c:
            for name in list(c.env):  # elastic-run's defaults, never a developer shell's
                if name.startswith(("ELASTIC_", "PET_")):
                    del c.env[name]
            undisturbed = self.start_reference(c.env)
            try:
                outcome = self.job(c, aws, aws_url)
                outcome.reference, outcome.reference_ids = self.reference(undisturbed)
            finally:
                if undisturbed.poll() is None:
                    undisturbed.kill()
                    undisturbed.wait(30)
        outcome.wall_s = time.monotonic() - started
        return outcome

    def job(self, c: Cluster, aws: Any, aws_url: str) -> Outcome:
        """The job on three agents, through the three faults (module docstring)."""
        self.open_gate(0)
        metrics_port = free_port()
        args = self.script_args(self.ckpt, self.audit, self.weights, str(self.gate))
        base = ["--etcd", c.endpoint, "--job-id", c.job_id, "--nproc-per-node", "1",
                "--min-nodes", "1", "--max-nodes", "3", "--rdzv-conf", RDZV_CONF,
                "--monitor-interval", "0.1", "--events-dir", str(self.events)]
        agents = [
            c.start([*base, "--metrics-port", str(metrics_port)], args),
            c.start(base, args),
            c.start([*base, "--preemption-watch", "aws", "--aws-metadata-url", aws_url], args),
        ]
        restores: list[tuple[str, Round, int]] = []

        # 1. A world of 3; a worker SIGKILL (steps since the last save are redone).
        first = self.world_of(c, 3)
        self.run_to(c, first, first.resumed + EVERY + 2)
        victim = self.worker_of(c, agents[1])
        after_kill = self.fault_then_world(c, lambda: os.kill(victim, signal.SIGKILL), 3,
                                           after=first.round)
        restores.append(("worker SIGKILL", after_kill,
                         self.newest_committed(first.resumed + EVERY + 2)))

        # 2. A preemption notice on node 2: drain, final checkpoint, node 2 leaves.
        self.run_to(c, after_kill, after_kill.resumed + 3)
        aws.preempt()
        wait_until(self.departure_noticed, WAIT_S, "node 2's agent to hear the notice",
                   give_up=c.all_exited)
        self.open_gate(after_kill.resumed + 30)
        # The world after the drain resumes from its final checkpoint: from then on, hold
        # every world at the step it resumes from (see fault_then_world).
        self.wait(c, self.final_committed, "the drain's final checkpoint")
        self.open_gate(0)
        codes: dict[str, int | None] = {"preempted": agents[2].wait(WAIT_S)}
        after_drain = self.world_of(c, 2, after=after_kill.round)
        restores.append(("preemption notice", after_drain,
                         self.newest_committed(after_drain.resumed)))

        # 3. Node 1's agent and worker SIGKILLed: node 0 goes on alone.
        self.run_to(c, after_drain, after_drain.resumed + 4)
        alone = self.fault_then_world(c, agents[1].kill_tree, 1, after=after_drain.round)
        restores.append(("node SIGKILL", alone,
                         self.newest_committed(after_drain.resumed + 4)))
        self.run_to(c, alone, alone.resumed + 2)
        metrics = self.scrape(metrics_port)
        self.open_gate(STEPS + 1)
        codes["survivor"] = agents[0].wait(WAIT_S)
        codes["killed"] = agents[1].proc.poll()
        assert codes["survivor"] == 0, c.logs()
        goodput = json.loads(subprocess.run(
            [sys.executable, "-m", "launch", "goodput", str(self.events), "--json"],
            cwd=REPO, env=c.env, capture_output=True, text=True, timeout=120,
            check=True).stdout)
        assert len(goodput) == 1, goodput
        return Outcome(
            rounds=read_rounds(self.audit), restores=restores,
            drained_at=after_drain.resumed, committed=committed_steps(self.ckpt),
            weights=torch.load(self.weights, weights_only=True), reference={},
            reference_ids={}, goodput=goodput[0], metrics=metrics, codes=codes, wall_s=0.0,
            events=sorted(read_events(self.events), key=lambda e: e["time"]))

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, c: Cluster, found: Callable[[], Any], what: str) -> Any:
        box: list[Any] = []

        def check() -> bool:
            hit = found()
            if hit:
                box[:] = [hit]
            return bool(hit)

        try:
            wait_until(check, WAIT_S, what, give_up=c.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from None
        return box[0]

    def world_of(self, c: Cluster, size: int, after: int = -1) -> Round:
        """The first round after ``after`` with ``size`` workers that all resumed."""
        def found() -> Round | None:
            for number, r in sorted(read_rounds(self.audit).items()):
                if number > after and r.world == size:
                    return r
            return None

        return self.wait(c, found, f"a world of {size} after round {after}")  # type: ignore[no-any-return]

    def run_to(self, c: Cluster, r: Round, count: int) -> None:
        """Lets round ``r`` train until ``count`` steps are done, and waits until every rank
        is held at the gate before the next one (its saves of ``count`` are committed)."""
        self.open_gate(count)

        def found() -> bool:
            current = read_rounds(self.audit).get(r.round)
            return current is not None and len(current.held[count]) == current.world

        self.wait(c, found, f"round {r.round} to hold at step {count}")

        # A worker's step records reach its agent's log up to 0.15 s after the step (they
        # are coalesced), so a node SIGKILLed right after its rank 0 was held loses them
        # (as designed: a dead node loses its last fraction of a second of events). The
        # faults land once the held steps are in the job log, so its goodput report must
        # count every step of the job.
        self.wait(c, lambda: self.steps_logged(count), f"the job log to hold the step "
                  f"records of the first {count} steps")

    def steps_logged(self, count: int) -> bool:
        """Whether the job log holds a step record of each of the first ``count`` steps."""
        done = {int(e["step"]) for e in read_events(self.events) if e["event"] == "step"}
        return set(range(count)) <= done

    def fault_then_world(self, c: Cluster, fault: Callable[[], object], size: int,
                         after: int) -> Round:
        """Injects ``fault`` into a world held at the gate and returns the next world of
        ``size``, held at the step it resumed from.

        The gate is closed first (0: every step is held): the next world resumes from the
        newest committed checkpoint, which may be steps behind the gate the last world was
        held at, and a worker started warm trains those steps in milliseconds, past the
        count a later :meth:`run_to` asks for, before the test has even seen it resume
        (it then waited forever for a hold that had gone by). The held world stays held.
        """
        self.open_gate(0)
        fault()
        return self.world_of(c, size, after=after)

    def final_committed(self) -> bool:
        """Whether a final checkpoint (a drain's) is committed."""
        return any(record.get("meta", {}).get("final") is True
                   for record in committed_steps(self.ckpt).values())

    def worker_of(self, c: Cluster, agent: Agent) -> int:
        return int(self.wait(c, lambda: (agent.worker_pids() or [0])[0],
                             f"a worker of agent {agent.pid}"))

    def newest_committed(self, count: int) -> int:
        """The newest committed checkpoint of at most ``count`` steps (what a world stopped
        after ``count`` steps must resume from; 0: none, a fresh start)."""
        steps = [s for s in committed_steps(self.ckpt) if s <= count]
        return max(steps, default=0)

    def departure_noticed(self) -> bool:
        return any(e["event"] == "planned_departure" for e in read_events(self.events))

    @staticmethod
    def scrape(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            return str(reply.read().decode())


def metric(text: str, name: str) -> float:
    """The value of an unlabelled-by-kind sample ``name`` in a Prometheus scrape."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the scrape:\n{text[:3000]}")


def worst_difference(outcome: Outcome) -> float:
    """The largest difference between the job's final weights and the undisturbed run's."""
    assert outcome.weights.keys() == outcome.reference.keys()
    return max((outcome.weights[k] - outcome.reference[k]).abs().max().item()
               for k in outcome.weights)


def check(outcome: Outcome) -> None:
    """The acceptance assertions shared by both frameworks (module docstring)."""
    # Each world after a fault resumed from the newest committed checkpoint at its start.
    for fault, r, newest in outcome.restores:
        assert r.resumed == newest, (fault, r.resumed, newest, sorted(outcome.committed))
    # The drain: a final checkpoint, committed, at the step the next world resumed from.
    drained = outcome.committed.get(outcome.drained_at)
    assert drained is not None and drained["meta"]["final"] is True, outcome.committed
    assert outcome.codes["preempted"] == 0, outcome.codes
    assert outcome.codes["killed"] is not None and outcome.codes["killed"] < 0, outcome.codes
    # Every step's global batch was trained exactly once (its last execution), the same
    # samples as the undisturbed run's.
    trained = final_ids(outcome.rounds)
    assert sorted(trained) == list(range(STEPS)), sorted(trained)
    for step in range(STEPS):
        assert Counter(trained[step]) == Counter(outcome.reference_ids[step]), step
        assert len(trained[step]) == GLOBAL_BATCH, step
    worlds = sorted({r.world for r in outcome.rounds.values()})
    assert {1, 2, 3} <= set(worlds), worlds
    # The final weights are the undisturbed run's.
    worst = worst_difference(outcome)
    assert worst < 1e-9, f"final weights differ from the undisturbed run's by {worst}"
    # The goodput report covers the job's steps, and the departure as planned and drained.
    job = outcome.goodput
    assert job["steps"] == STEPS and job["finished"] is True, job
    assert job["productive_s"] is not None and job["productive_s"] > 0, job
    assert [(d["planned"], d["cause"], d["drained"]) for d in job["departures"]
            if d["planned"]] == [(True, "aws", True)], job["departures"]
    assert job["checkpoint_s"] > 0, job
    assert len([e for e in outcome.events if e["event"] == "restored" and e["found"]]) >= 3
    # The surviving node's metrics saw the steps and the commits.
    assert metric(outcome.metrics, "elastic_run_steps_total") > 0, outcome.metrics[:2000]
    assert metric(outcome.metrics, "elastic_run_checkpoint_last_committed_step") >= \
        outcome.restores[-1][1].resumed
