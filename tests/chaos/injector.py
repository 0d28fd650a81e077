"""A declarative fault injector for real ``elastic-run`` jobs, and the checks every run must pass.

A scenario is a list of :class:`Fault` s, each triggered when the job has trained up to a step
(``at_step``: the highest step any rank has logged in its audit file) or a time after the first
step (``at_time``)::

    run = ChaosRun(env, [Fault("kill_worker", at_step=5, node=1),
                         Fault("partition_node", at_step=15, node=0, duration=6)])
    result = run.execute()
    result.check()          # raises AssertionError naming what went wrong

What a run really does (everything on 127.0.0.1):

* ``nodes`` ``elastic-run`` agents (``--nnodes 1:N``, one gloo worker each) train the float64
  MLP of ``tests/integration/training/worker.py`` through ``ElasticLoop`` +
  ``ElasticSampler`` + ``CheckpointManager``; every rank logs the sample ids of every step.
* etcd is a real 3-member cluster (:class:`~launch.etcd_server.EmbeddedEtcdCluster`).
  Each node's agent reaches every member through a TCP proxy of its own
  (:class:`~tests.support.fault_proxy.FaultProxy`), so one node can be cut off from etcd
  while the others are not.
* Checkpoints go to a local directory, or, with ``s3=True`` (implied by a ``storage_outage``),
  to moto's S3 server behind another proxy.

Faults (``node`` is a node slot, 0..N-1; a killed node's slot gets a fresh agent):

=================  ==============================================================================
kill_worker        SIGKILL the node's worker process (a crash: charged to --max-restarts)
kill_node          SIGKILL the agent's whole process tree; a new agent joins ``rejoin_after`` s
                   later in the same slot
sigstop_worker     SIGSTOP the node's worker for ``duration`` s, then SIGCONT
kill_etcd_member   SIGKILL etcd member ``member``; restarted ``duration`` s later
partition_node     blackhole the node's etcd proxies for ``duration`` s (its workers' gloo links
                   to the other nodes stay up: only its path to etcd is cut)
storage_outage     reset every connection to S3 for ``duration`` s
pause_etcd         SIGSTOP every etcd member for ``duration`` s (5 s when drawn: past the 3 s
                   lease TTL, so every node's lease expires), then SIGCONT: every node takes a
                   new lease and joins again, and the job trains on without reading storage
=================  ==============================================================================

The partition is a per-node proxy, not network namespaces with nftables: this machine has
neither ``nft`` nor ``iptables``, and the proxy needs no root; what it cuts is exactly the
node's etcd traffic.

The workers' steps are gated (``--gate-file``): step 0 waits until all nodes are in one round,
and training never runs more than ``GATE_AHEAD`` steps past the next pending step-triggered
fault, so that every fault lands while the job trains.

:meth:`RunResult.check` asserts correctness, not only survival: every agent that was not killed
exits 0; the final weights equal the undisturbed run's (float64, max abs diff < 1e-5); the
steps of the final history trained every sample of every epoch exactly once, in the documented
order; the last checkpoint is the last step and loads and verifies; no process the run started
is still running.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from tests.integration.launcher_scripts.harness import FAST_RDZV_CONF, Agent, tree
from tests.integration.training.harness import (
    WORKER,
    committed_steps,
    reference_order,
    rounds,
)
from tests.support.fault_proxy import FaultProxy

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
KINDS = ("kill_worker", "kill_node", "sigstop_worker", "kill_etcd_member", "partition_node",
         "storage_outage", "pause_etcd")
#: Faults whose effect lasts ``duration`` seconds.
TIMED = frozenset({"sigstop_worker", "kill_etcd_member", "partition_node", "storage_outage",
                   "pause_etcd"})
#: How long a drawn ``pause_etcd`` lasts: past the agents' lease TTL (3 s).
PAUSE_ETCD_S = 5.0
GATE_AHEAD = 4
_POLL_S = 0.1
_WORKER_WAIT_S = 20.0
_AWS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class Fault:
    """One fault of a scenario.

    Args:
        kind: One of :data:`KINDS`.
        at_step: Inject once the job has trained this step (highest step logged so far).
        at_time: Or inject this many seconds after the job's first step.
        node: The node slot it hits (worker, node and partition faults).
        member: The etcd member it kills (``kill_etcd_member``).
        duration: Seconds the fault lasts (timed faults).
        rejoin_after: ``kill_node``: seconds until a new agent starts in the slot.
    """

    kind: str
    at_step: int | None = None
    at_time: float | None = None
    node: int = 0
    member: int = 0
    duration: float = 3.0
    rejoin_after: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind ({self.kind!r}) is unknown; use one of {KINDS}.")
        if (self.at_step is None) == (self.at_time is None):
            raise ValueError(f"fault {self.kind} needs exactly one of at_step or at_time "
                             f"(got {self.at_step!r} and {self.at_time!r}).")
        if self.duration < 0 or self.rejoin_after < 0:
            raise ValueError(f"fault {self.kind}: duration ({self.duration}) and rejoin_after "
                             f"({self.rejoin_after}) must not be negative.")

    def describe(self) -> str:
        when = f"step {self.at_step}" if self.at_step is not None else f"t+{self.at_time}s"
        what = {"kill_etcd_member": f"member {self.member}", "storage_outage": "storage",
                "pause_etcd": "every member"}.get(self.kind, f"node {self.node}")
        timed = f" for {self.duration:g}s" if self.kind in TIMED else ""
        return f"{self.kind} {what}{timed} at {when}"


@dataclass(frozen=True)
class JobShape:
    """The training job every run trains (and the undisturbed reference run too)."""

    steps: int = 40
    interval: int = 5
    global_batch: int = 12
    micro_batch: int = 3
    dataset: int = 100
    seed: int = 11  # the worker's sampler seed

    def worker_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--interval", str(self.interval),
                "--global-batch", str(self.global_batch), "--micro-batch",
                str(self.micro_batch), "--dataset-size", str(self.dataset)]


class ChaosEnv:
    """What every run of a session shares: a 3-member etcd cluster and an S3 server.

    Use as a context manager; :func:`chaos_env` builds one.
    """

    def __init__(self, root: Path) -> None:
        from launch.etcd_server import EmbeddedEtcdCluster

        self.root = root
        self.etcd = EmbeddedEtcdCluster(3)
        self._moto: Any = None
        self.s3_endpoint: str | None = None
        self._references: dict[JobShape, Path] = {}

    def start(self) -> None:
        self.etcd.start()

    def s3(self) -> str:
        """``http://host:port`` of a moto S3 server, started on first use."""
        if self.s3_endpoint is None:
            from moto.server import ThreadedMotoServer

            for key, value in _AWS.items():
                os.environ.setdefault(key, value)
            self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
            self._moto.start()
            host, port = self._moto.get_host_and_port()
            self.s3_endpoint = f"http://{host}:{port}"
        return self.s3_endpoint

    def stop(self) -> None:
        if self._moto is not None:
            self._moto.stop()
        self.etcd.stop()

    def reference(self, shape: JobShape) -> Path:
        """Weights of the undisturbed job (one worker under torchrun), computed once."""
        if shape not in self._references:
            out = self.root / f"reference-{uuid.uuid4().hex[:6]}"
            out.mkdir(parents=True)
            weights = out / "weights.pt"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=1", "--max-restarts=0", str(WORKER),
                   "--checkpoint-dir", str(out / "ckpt"), "--audit-dir", str(out / "audit"),
                   "--weights-out", str(weights), *shape.worker_args()]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                                  timeout=120, check=False)
            if done.returncode != 0 or not weights.exists():
                raise AssertionError(f"the undisturbed reference run failed:\n"
                                     f"{(done.stdout + done.stderr)[-3000:]}")
            self._references[shape] = weights
        return self._references[shape]


@contextmanager
def chaos_env(root: Path) -> Iterator[ChaosEnv]:
    """A started :class:`ChaosEnv` that is stopped (every process of it) when the block ends."""
    env = ChaosEnv(root)
    try:
        env.start()
        yield env
    finally:
        env.stop()


FaultT = TypeVar("FaultT")


@dataclass
class Injected(Generic[FaultT]):
    """What happened to one fault (a :class:`Fault` here, a ``NetnsFault`` in place)."""

    fault: FaultT
    at: float | None = None  # seconds after the first step; None: never injected
    at_step: int | None = None
    note: str = ""


@dataclass
class RunResult:
    """Everything a run produced, and the checks of correctness."""

    root: Path
    shape: JobShape
    reference: Path
    checkpoint_url: str
    storage_options: dict[str, Any]
    injected: list[Injected[Fault]]
    exit_codes: dict[str, int | str]  # agent log -> exit code, "killed" (a fault), "running"
    spawned: dict[int, int]  # pid -> start time (/proc stat field 22)
    wall_s: float
    hung: str | None = None
    logs: str = ""
    worlds: list[int] = field(default_factory=list)  # world size of each round, in order
    checks: dict[str, str] = field(default_factory=dict)

    @property
    def audit(self) -> Path:
        return self.root / "audit"

    @property
    def events(self) -> Path:
        return self.root / "events"

    def check(self) -> None:
        """Asserts every correctness property (see the module docstring)."""
        context = f"faults: {[i.fault.describe() for i in self.injected]}\n"
        assert self.hung is None, f"{context}the run hung: {self.hung}\n{self.logs}"
        assert all(i.at is not None for i in self.injected), (
            context + "; ".join(f"{i.fault.describe()}: {i.note}" for i in self.injected
                                if i.at is None))
        bad = {name: code for name, code in self.exit_codes.items()
               if code not in (0, "killed")}
        assert not bad, f"{context}agents exited non-zero: {bad}\n{self.logs}"
        assert any(code == 0 for code in self.exit_codes.values()), self.logs
        self.checks["exit"] = "ok"
        self._check_weights(context)
        self._check_audit(context)
        self._check_checkpoint(context)
        self._check_processes(context)

    def _check_weights(self, context: str) -> None:
        weights = self.root / "weights.pt"
        assert weights.exists(), f"{context}no final weights written\n{self.logs}"
        got = torch.load(weights, weights_only=True)
        want = torch.load(self.reference, weights_only=True)
        assert got.keys() == want.keys()
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst < 1e-5, f"{context}final weights differ from the undisturbed run by {worst}"
        self.checks["weights"] = f"max abs diff {worst:.2e}"

    def _check_audit(self, context: str) -> None:
        shape = self.shape
        trained = committed_steps(self.audit)
        assert sorted(trained) == list(range(shape.steps)), (
            f"{context}steps of the final history: {sorted(trained)}")
        epochs = shape.steps * shape.global_batch // shape.dataset + 1
        stream = [i for e in range(epochs) for i in reference_order(shape.dataset, shape.seed, e)]
        for step in range(shape.steps):
            expected = stream[step * shape.global_batch:(step + 1) * shape.global_batch]
            assert Counter(trained[step]) == Counter(expected), (
                f"{context}step {step} trained {sorted(trained[step])}, expected "
                f"{sorted(expected)}")
        counts = Counter(i for ids in trained.values() for i in ids)
        full, partial = divmod(shape.steps * shape.global_batch, shape.dataset)
        last_epoch = set(reference_order(shape.dataset, shape.seed, full)[:partial])
        wrong = {i: counts[i] for i in range(shape.dataset)
                 if counts[i] != full + (i in last_epoch)}
        assert not wrong, f"{context}samples trained the wrong number of times: {wrong}"
        self.checks["audit"] = "exactly once"

    def _check_checkpoint(self, context: str) -> None:
        from torch import nn

        from checkpointing import CheckpointManager, ModelOptimizerState

        manager = CheckpointManager(self.checkpoint_url, storage_options=self.storage_options,
                                    async_mode="disabled")
        try:
            latest = manager.latest()
            assert latest is not None and latest.step == self.shape.steps, (
                f"{context}latest checkpoint: {latest}")
            manager.verify(latest)  # sizes and CRC32s of every file of the commit record
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            info = manager.load({"train": ModelOptimizerState(model, optimizer)})
            assert info is not None and info.step == self.shape.steps
        finally:
            manager.close()
        want = torch.load(self.root / "weights.pt", weights_only=True)
        worst = max((model.state_dict()[k] - want[k]).abs().max().item() for k in want)
        assert worst == 0.0, f"{context}the last checkpoint holds other weights ({worst})"
        self.checks["checkpoint"] = f"step {latest.step} loads and verifies"

    def _check_processes(self, context: str) -> None:
        deadline = time.monotonic() + 15
        while True:
            left = [pid for pid, start in self.spawned.items() if _start_time(pid) == start]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"{context}processes still running after the job: {left}"
        self.checks["processes"] = f"all {len(self.spawned)} gone"


def _start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) ``pid``, or None: identifies a pid across reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


class _Node:
    """One node slot: its etcd proxies and its current agent."""

    def __init__(self, index: int, proxies: list[FaultProxy]) -> None:
        self.index = index
        self.proxies = proxies
        self.agent: Agent | None = None
        self.killed: list[Agent] = []

    @property
    def endpoints(self) -> str:
        return ",".join(f"{p.host}:{p.port}" for p in self.proxies)

    def worker(self) -> int | None:
        """Pid of the agent's worker (its child process), if it runs one now."""
        if self.agent is None or self.agent.proc.poll() is not None:
            return None
        kids = self.agent.worker_pids()
        return kids[0] if kids else None


class ChaosRun:
    """One job under one scenario; :meth:`execute` runs it and returns a :class:`RunResult`.

    Args:
        env: The shared etcd cluster and S3 server.
        faults: The scenario.
        nodes: Node slots (agents at the start).
        shape: The training job.
        step_time: Seconds each step sleeps (so that faults land mid-training).
        timeout: Seconds the whole run may take before it counts as hung.
        stall_timeout: Seconds without any new audit line (no step trained, no round
            started) before the run counts as hung, however much of ``timeout`` is left.
        s3: Checkpoint to S3 (implied by a ``storage_outage`` fault).
        loader_workers: DataLoader worker processes per rank.
        name: Directory name of the run under ``env.root``.
    """

    def __init__(self, env: ChaosEnv, faults: Sequence[Fault], *, nodes: int = 2,
                 shape: JobShape | None = None, step_time: float = 0.05,
                 timeout: float = 55.0, stall_timeout: float = 75.0, s3: bool = False,
                 loader_workers: int = 0, name: str | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes ({nodes}) must be at least 1.")
        for fault in faults:
            if fault.kind != "kill_etcd_member" and not 0 <= fault.node < nodes:
                raise ValueError(f"fault {fault.describe()}: node must be in [0, {nodes}).")
            if fault.kind == "kill_etcd_member" and not 0 <= fault.member < 3:
                raise ValueError(f"fault {fault.describe()}: member must be 0, 1 or 2.")
        self.env = env
        self.faults = list(faults)
        self.nodes = nodes
        self.shape = shape or JobShape()
        self.step_time = step_time
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self._last_size = -1
        self._last_progress = time.monotonic()
        self.s3 = s3 or any(f.kind == "storage_outage" for f in faults)
        self.loader_workers = loader_workers
        self.job_id = f"chaos-{uuid.uuid4().hex[:8]}"
        self.root = env.root / (name or self.job_id)
        self.root.mkdir(parents=True, exist_ok=True)
        self._agents: list[Agent] = []
        self._spawned: dict[int, int] = {}
        self._lock = threading.Lock()
        self._timers: list[threading.Thread] = []
        self._first_step: float | None = None

    # -- set-up ------------------------------------------------------------------------------

    def _start_agent(self, node: _Node) -> None:
        args = [
            sys.executable, "-m", "launch", "--etcd", node.endpoints, "--job-id", self.job_id,
            "--nnodes", f"1:{self.nodes}", "--nproc-per-node", "1", "--max-restarts", "20",
            "--rdzv-conf", FAST_RDZV_CONF, "--monitor-interval", "0.1",
            "--events-dir", str(self.root / "events"),
            str(WORKER), "--checkpoint-dir", self.checkpoint_url,
            "--audit-dir", str(self.root / "audit"), "--weights-out",
            str(self.root / "weights.pt"), "--workers", str(self.loader_workers),
            "--step-time", str(self.step_time), "--gate-file", str(self.root / "gate"),
            *self.shape.worker_args(),
        ]
        with self._lock:
            log = self.root / f"node{node.index}.agent{len(self._agents)}.log"
            agent = Agent(args, log, self._env)
            self._agents.append(agent)
            node.agent = agent
        self._track()

    def _track(self) -> None:
        """Records every process of every agent's tree (polled; checked at the end)."""
        with self._lock:
            agents = list(self._agents)
        for agent in agents:
            for pid in tree(agent.pid):
                start = _start_time(pid)
                if start is not None:
                    self._spawned.setdefault(pid, start)

    def _gate(self, up_to: int) -> None:
        gate = self.root / "gate"
        tmp = gate.with_suffix(".tmp")
        tmp.write_text(str(up_to))
        os.replace(tmp, gate)

    def _progress(self) -> tuple[int, int]:
        """``(highest step logged, largest world of the newest round)``."""
        rs = rounds(self.root / "audit")
        if not rs:
            return -1, 0
        return max(r.last_step for r in rs), rs[-1].world

    # -- faults ------------------------------------------------------------------------------

    def _later(self, delay: float, fn: Any) -> None:
        def run() -> None:
            time.sleep(delay)
            try:
                fn()
            except Exception:
                logger.exception("chaos: delayed action failed")

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._timers.append(thread)

    def _inject(self, fault: Fault, node: _Node | None, s3_proxy: FaultProxy | None) -> str:
        kind = fault.kind
        if kind in ("kill_worker", "sigstop_worker"):
            assert node is not None
            deadline = time.monotonic() + _WORKER_WAIT_S
            pid = node.worker()
            while pid is None and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                pid = node.worker()
            if pid is None:
                return "no worker ran on the node"
            self._track()
            if kind == "kill_worker":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                self._later(fault.duration, lambda: _cont(pid))
                time.sleep(fault.duration)
        elif kind == "kill_node":
            assert node is not None and node.agent is not None
            self._track()
            agent = node.agent
            node.killed.append(agent)
            node.agent = None
            agent.kill_tree()
            time.sleep(fault.rejoin_after)
            self._start_agent(node)
        elif kind == "kill_etcd_member":
            member = self.env.etcd.members[fault.member]
            member.kill()
            time.sleep(fault.duration)
            member.restart()
        elif kind == "partition_node":
            assert node is not None
            before = sum(p.faulted for p in node.proxies)
            for proxy in node.proxies:
                proxy.blackhole(fault.duration)
            time.sleep(fault.duration)
            for proxy in node.proxies:
                proxy.heal()
            return f"ok: {sum(p.faulted for p in node.proxies) - before} etcd connections held"
        elif kind == "pause_etcd":
            members = self.env.etcd.members
            for member in members:
                member.pause()
            try:
                time.sleep(fault.duration)
            finally:
                for member in members:
                    member.resume()
        elif kind == "storage_outage":
            assert s3_proxy is not None
            before = s3_proxy.faulted
            s3_proxy.reset(fault.duration)
            time.sleep(fault.duration)
            s3_proxy.heal()
            return f"ok: {s3_proxy.faulted - before} S3 connections reset"
        return "ok"

    # -- the run -----------------------------------------------------------------------------

    def execute(self) -> RunResult:
        """Runs the job under the scenario; every process it started is gone on return."""
        started = time.monotonic()
        injected = [Injected(f) for f in self.faults]
        hung: str | None = None
        with ExitStack() as stack:
            s3_proxy: FaultProxy | None = None
            self.storage_options: dict[str, Any] = {}
            self._env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO")
            self._env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            if self.s3:
                import s3fs

                host, port = self.env.s3().removeprefix("http://").split(":")
                s3_proxy = stack.enter_context(FaultProxy(host, int(port)))
                bucket = f"chaos-{uuid.uuid4().hex[:10]}"
                s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.env.s3()}, key="x",
                                  secret="x", skip_instance_cache=True).mkdir(bucket)
                self.checkpoint_url = f"s3://{bucket}/{self.job_id}"
                # The workers reach S3 only through the proxy (botocore reads this variable).
                self._env.update(_AWS, AWS_ENDPOINT_URL_S3=s3_proxy.endpoint)
                self.storage_options = {"client_kwargs": {"endpoint_url": self.env.s3()},
                                        "key": "x", "secret": "x"}
            else:
                self.checkpoint_url = str(self.root / "ckpt")
            nodes = []
            for index in range(self.nodes):
                proxies = []
                for member in self.env.etcd.members:
                    host, port = member.endpoint.rsplit(":", 1)
                    proxies.append(stack.enter_context(FaultProxy(host, int(port))))
                nodes.append(_Node(index, proxies))
            stack.callback(self._stop_all)
            self._gate(0)  # step 0 waits for every node
            for node in nodes:
                self._start_agent(node)
            try:
                self._drive(nodes, injected, s3_proxy, started)
            except TimeoutError as exc:
                hung = str(exc)
            for thread in self._timers:
                thread.join(timeout=30)
            self._track()
            wall = time.monotonic() - started
            codes: dict[str, int | str] = {}
            for node in nodes:
                for agent in node.killed:
                    codes[agent.log.name] = "killed"
                if node.agent is not None:
                    code = node.agent.proc.poll()
                    codes[node.agent.log.name] = "running" if code is None else code
            logs = "\n".join(f"--- {a.log.name}\n{a.output()[-2500:]}" for a in self._agents)
        return RunResult(
            root=self.root, shape=self.shape, reference=self.env.reference(self.shape),
            checkpoint_url=self.checkpoint_url, storage_options=self.storage_options,
            injected=injected, exit_codes=codes, spawned=dict(self._spawned), wall_s=wall,
            hung=hung, logs=logs, worlds=[r.world for r in rounds(self.root / "audit")],
        )

    def _deadline_check(self, started: float, what: str) -> None:
        self._track()
        now = time.monotonic()
        size = sum(p.stat().st_size for p in (self.root / "audit").glob("*.jsonl"))
        if size != self._last_size:
            self._last_size, self._last_progress = size, now
        if now - started > self.timeout:
            raise TimeoutError(f"{what} after {self.timeout:.0f} s")
        if now - self._last_progress > self.stall_timeout:
            raise TimeoutError(f"{what}: no step trained for {self.stall_timeout:.0f} s")

    def _drive(self, nodes: list[_Node], injected: list[Injected[Fault]],
               s3_proxy: FaultProxy | None, started: float) -> None:
        # 1. Every node in one round before step 0.
        while self._progress()[1] < self.nodes:
            self._deadline_check(started, f"waiting for a world of {self.nodes}")
            time.sleep(_POLL_S)
        self._first_step = time.monotonic()
        pending = sorted(injected, key=lambda i: (i.fault.at_step if i.fault.at_step is not None
                                                  else 1 << 30, i.fault.at_time or 0.0))
        # 2. Each fault once its trigger is reached; the gate keeps training just ahead.
        for item in pending:
            fault = item.fault
            hold = self.shape.steps if fault.at_step is None else min(
                self.shape.steps, fault.at_step + GATE_AHEAD)
            self._gate(hold)
            while True:
                step, _ = self._progress()
                now = time.monotonic() - self._first_step
                if (fault.at_step is not None and step >= fault.at_step) or (
                        fault.at_time is not None and now >= fault.at_time):
                    break
                if all(n.agent is None or n.agent.proc.poll() is not None for n in nodes):
                    item.note = "every agent exited before the trigger"
                    break
                self._deadline_check(started, f"waiting to inject {fault.describe()}")
                time.sleep(_POLL_S)
            if item.note:
                continue
            item.at = round(time.monotonic() - self._first_step, 2)
            item.at_step = self._progress()[0]
            node = nodes[fault.node] if fault.kind != "kill_etcd_member" else None
            logger.warning("chaos: %s (trained up to step %s)", fault.describe(), item.at_step)
            note = self._inject(fault, node, s3_proxy)
            if note.startswith("ok"):
                item.note = note.removeprefix("ok").removeprefix(": ")
            else:
                item.at, item.note = None, note
        # 3. The rest of the job.
        self._gate(self.shape.steps)
        while any(n.agent is not None and n.agent.proc.poll() is None for n in nodes):
            self._deadline_check(started, "waiting for the job to finish")
            time.sleep(_POLL_S)

    def _stop_all(self) -> None:
        with self._lock:
            agents = list(self._agents)
        for agent in agents:
            agent.stop()


def _cont(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def random_faults(rng: random.Random, count: int, *, nodes: int, steps: int,
                  kinds: Sequence[str] = KINDS) -> list[Fault]:
    """``count`` faults of random kinds on random nodes, at random steps spread over the job.

    Steps are drawn without replacement from ``[3, steps - 3]`` and kept at least 3 apart, so
    that each fault hits a job that trains; durations are 1-6 s (well below etcd's 30 s
    deadline and the storage retry deadline: a longer outage is a different, tested story);
    a killed node's replacement starts 0-8 s later (sometimes before the survivors' new round
    forms, sometimes after they went on without it).
    """
    span = list(range(3, steps - 3, 3))
    if count > len(span):
        raise ValueError(f"{count} faults do not fit a job of {steps} steps; use at most "
                         f"{len(span)} per run.")
    at = sorted(rng.sample(span, count))
    faults = []
    for step in at:
        kind = rng.choice(list(kinds))
        duration = round(rng.uniform(1.0, 6.0), 1)
        faults.append(Fault(kind, at_step=step, node=rng.randrange(nodes),
                            member=rng.randrange(3),
                            duration=PAUSE_ETCD_S if kind == "pause_etcd" else duration,
                            rejoin_after=round(rng.uniform(0.0, 8.0), 1)))
    return faults


def summary(result: RunResult) -> dict[str, Any]:
    """One JSON-ready line about a run (for the campaign's log)."""
    return {
        "root": str(result.root), "wall_s": round(result.wall_s, 1),
        "faults": [{"fault": i.fault.describe(), "at_s": i.at, "trained_up_to": i.at_step,
                    "note": i.note} for i in result.injected],
        "worlds": result.worlds, "exit_codes": result.exit_codes, "checks": result.checks,
        "hung": result.hung,
    }


def dump(result: RunResult) -> str:
    return json.dumps(summary(result))
