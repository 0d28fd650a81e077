"""The in-place chaos campaign's runs: elastic-run in place on a cluster of network namespaces.

:mod:`tests.chaos.injector` drives the restart path on 127.0.0.1, where a dead process's
kernel answers at once. Here every node is a network namespace with its own address
(:mod:`tests.support.netns`), so a host can really go silent; the job is
``tests/integration/training/inplace_worker.py`` (float64, in place, the per-sample audit,
a gate file and the hang hook) started on every node by ``elastic-run`` with only the flags
a user passes (``--min-nodes 1 --max-nodes N``, ``--etcd``, ``--job-id``). etcd is a
3-member cluster in namespaces of its own; with a storage outage in the scenario,
checkpoints go to S3 (moto, in the observer's namespace, behind a
:class:`~tests.support.fault_proxy.FaultProxy`).

Faults (``node`` is a node slot, 0..N-1; a slot whose host is lost gets a new one):

=================  ==============================================================================
kill_worker        SIGKILL the slot's worker (a crash: charged to the node's --max-restarts)
kill_node          SIGKILL the agent's whole tree; a new agent starts in the same namespace
                   ``rejoin_after`` s later
sigstop_worker     SIGSTOP the slot's worker for ``duration`` s, then SIGCONT (its agent replaces
                   it after the TTL when the stop lasts longer)
hang_worker        hold the slot's worker before its step's collective for ``duration`` s while
                   its threads run on (the progress rule evicts it once the others waited
                   ``--hang-timeout``)
silent_host        cut the slot's link for good (no reset, no answer); a replacement node starts
                   in a spare namespace ``rejoin_after`` s later
host_returns       cut the slot's link for ``duration`` s (sometimes longer than the etcd
                   deadline), then restore it: the node rejoins or exits 0
etcd_partition     cut the slot's node from every etcd member (not from its peers) for
                   ``duration`` s
kill_etcd_member   SIGKILL etcd member ``member`` for ``duration`` s, then start it again
storage_outage     reset every connection to S3 for ``duration`` s
=================  ==============================================================================

A host or partition fault on a slot waits until the slot's node has joined the job: a node
still probing etcd at start-up, cut off then, stops at once naming the endpoints (exit 3),
as it must when they are wrong.

Faults are injected one after the other, each once the job has trained up to its step (the
gate keeps training at most :data:`GATE_AHEAD` steps ahead of the next fault). Every run is
checked (:meth:`NetnsRunResult.check`): it did not hang (a cap on the run's time, and on the
time without any step); every agent that was not killed or lost exited 0; the final weights
equal the undisturbed run's (float64, within 1e-9); every step trained its global batch
exactly once (the audit); the last checkpoint is the last step, loads and verifies, and holds
the final weights; no process of a node that was not lost outlived its agent; nothing of the
cluster is left (no process, namespace, link or file).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from tests.chaos.injector import Injected
from tests.support import hang, proctree
from tests.support.fault_proxy import FaultProxy
from tests.support.netns import Host, NetnsCluster
from tests.support.netns_job import (
    DATASET,
    GLOBAL_BATCH,
    SEED,
    Launcher,
    NetnsJob,
    inplace_worker_args,
    undisturbed_run,
)

logger = logging.getLogger(__name__)

KINDS: Final = ("kill_worker", "kill_node", "sigstop_worker", "hang_worker", "silent_host",
                "host_returns", "etcd_partition", "kill_etcd_member", "storage_outage",
                "pause_etcd")
#: Faults whose effect lasts ``duration`` seconds.
TIMED: Final = frozenset({"sigstop_worker", "hang_worker", "host_returns", "etcd_partition",
                          "kill_etcd_member", "storage_outage", "pause_etcd"})
#: How long ``pause_etcd`` (every etcd member SIGSTOPped) lasts: past the lease TTL (3 s).
PAUSE_ETCD_S: Final = 5.0
#: Faults that start a new agent ``rejoin_after`` seconds later.
REJOINING: Final = frozenset({"kill_node", "silent_host"})
ETCD_MEMBERS: Final = 3
GATE_AHEAD: Final = 4
#: A cut at least this long outlasts the agents' etcd deadline (30 s) and the watch's idle
#: reconnect (10 s): the node's watch gives up while it is cut off.
LONG_CUT_S: Final = 42.0
#: Crashes the default ``--max-restarts`` (3) absorbs per node: a plan never charges more.
MAX_KILLS_PER_SLOT: Final = 3
_POLL_S: Final = 0.1
_WORKER_WAIT_S: Final = 60.0
_AWS: Final = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
               "AWS_DEFAULT_REGION": "us-east-1"}
_MOTO_PORT: Final = 5000


@dataclass(frozen=True)
class NetnsFault:
    """One fault of an in-place scenario.

    Args:
        kind: One of :data:`KINDS`.
        at_step: Inject once the job has trained this step (highest step completed so far).
        node: The node slot it hits (worker, node, host and partition faults).
        member: The etcd member it kills (``kill_etcd_member``).
        duration: Seconds the fault lasts (:data:`TIMED` faults).
        rejoin_after: Seconds until a new agent starts (:data:`REJOINING` faults).
    """

    kind: str
    at_step: int
    node: int = 0
    member: int = 0
    duration: float = 3.0
    rejoin_after: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind ({self.kind!r}) is unknown; use one of {KINDS}.")
        if self.at_step < 0 or self.duration < 0 or self.rejoin_after < 0:
            raise ValueError(f"fault {self.kind}: at_step ({self.at_step}), duration "
                             f"({self.duration}) and rejoin_after ({self.rejoin_after}) must "
                             "not be negative.")

    def describe(self) -> str:
        what = {"kill_etcd_member": f"member {self.member}", "storage_outage": "storage",
                "pause_etcd": "every member"}.get(self.kind, f"node {self.node}")
        timed = f" for {self.duration:g}s" if self.kind in TIMED else ""
        rejoin = f", new agent after {self.rejoin_after:g}s" if self.kind in REJOINING else ""
        return f"{self.kind} {what}{timed}{rejoin} at step {self.at_step}"


@dataclass(frozen=True)
class NetnsShape:
    """The training job every run trains (and the undisturbed reference run too)."""

    steps: int = 60
    interval: int = 5
    step_time: float = 0.05


def random_netns_faults(rng: random.Random, count: int, *, nodes: int, steps: int,
                        kinds: Sequence[str] = KINDS, long_cuts: bool = True
                        ) -> list[NetnsFault]:
    """``count`` faults of random kinds on random slots, at random steps spread over the job.

    Steps are drawn from ``[3, steps - 3]``, at least 3 apart. Durations: a SIGSTOP 1-12 s
    and a live hang 4-20 s (shorter or longer than the TTL, the hang threshold); a host
    that returns is cut 2-12 s, or one time in four (``long_cuts``) 42-50 s, longer than the
    etcd deadline; an etcd partition 1-8 s; an etcd member or the storage 1-6 s. A new
    agent starts 0-8 s after a node was killed or lost. A slot is never charged more crashes
    than the default ``--max-restarts`` absorbs.
    """
    span = list(range(3, steps - 3, 3))
    if count > len(span):
        raise ValueError(f"{count} faults do not fit a job of {steps} steps; use at most "
                         f"{len(span)} per run.")
    at = sorted(rng.sample(span, count))
    kills = [0] * nodes
    faults = []
    for step in at:
        kind = rng.choice(list(kinds))
        node = rng.randrange(nodes)
        member = rng.randrange(ETCD_MEMBERS)
        rejoin_after = round(rng.uniform(0.0, 8.0), 1)
        short, long_ = rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0)
        if kind == "kill_worker":
            if kills[node] >= MAX_KILLS_PER_SLOT:
                kind = "sigstop_worker"
            else:
                kills[node] += 1
        if kind in ("kill_node", "silent_host"):
            kills[node] = 0  # a new agent: a new crash budget
        duration = {
            "sigstop_worker": 1.0 + 11.0 * short,
            "hang_worker": 4.0 + 16.0 * short,
            "host_returns": (LONG_CUT_S + 8.0 * short) if long_cuts and long_ < 0.25
            else 2.0 + 10.0 * short,
            "etcd_partition": 1.0 + 7.0 * short,
            "pause_etcd": PAUSE_ETCD_S,
        }.get(kind, 1.0 + 5.0 * short)
        faults.append(NetnsFault(kind, at_step=step, node=node, member=member,
                                 duration=round(duration, 1), rejoin_after=rejoin_after))
    return faults


def reference_weights(root: Path, shape: NetnsShape) -> Path:
    """The undisturbed run's final weights (one process, no launcher), computed once per
    ``root``."""
    out = root / f"reference-{shape.steps}"
    weights = out / "weights.pt"
    if not weights.exists():
        undisturbed_run(out, steps=shape.steps)
    return weights


@dataclass
class NetnsRunResult:
    """Everything a run produced, and the checks of correctness."""

    root: Path
    shape: NetnsShape
    reference: Path
    injected: list[Injected[NetnsFault]]
    exit_codes: dict[str, int | str]  # launcher log -> code, "killed", "lost", "running"
    wall_s: float
    hung: str | None = None
    startup: str | None = None
    checkpoint: dict[str, Any] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    unclean: str | None = None
    logs: str = ""
    worlds: list[int] = field(default_factory=list)  # world size of each generation
    checks: dict[str, str] = field(default_factory=dict)

    @property
    def audit_dir(self) -> Path:
        return self.root / "audit"

    def check(self) -> None:
        """Asserts every correctness property (see the module docstring)."""
        from tests.integration.training.inplace_audit import check_exactly_once, read_audit

        context = f"faults: {[i.fault.describe() for i in self.injected]}\n"
        assert self.startup is None, f"{context}the job did not start: {self.startup}\n" \
            f"{self.logs}"
        assert self.hung is None, f"{context}the run hung: {self.hung}\n{self.logs}"
        assert all(i.at is not None for i in self.injected), (
            context + "; ".join(f"{i.fault.describe()}: {i.note}" for i in self.injected
                                if i.at is None))
        bad = {name: code for name, code in self.exit_codes.items()
               if code not in (0, "killed", "lost")}
        assert not bad, f"{context}agents exited non-zero: {bad}\n{self.logs}"
        assert any(code == 0 for code in self.exit_codes.values()), self.logs
        self.checks["exit"] = "ok"
        weights = self.root / "weights.pt"
        assert weights.exists(), f"{context}no final weights written\n{self.logs}"
        got = torch.load(weights, weights_only=True)
        want = torch.load(self.reference, weights_only=True)
        assert got.keys() == want.keys()
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst < 1e-9, f"{context}final weights differ from the undisturbed run by {worst}"
        self.checks["weights"] = f"max abs diff {worst:.1e}"
        try:
            check_exactly_once(read_audit(self.audit_dir), steps=self.shape.steps,
                               global_batch=GLOBAL_BATCH, dataset=DATASET, seed=SEED)
        except AssertionError as exc:
            raise AssertionError(f"{context}{exc}") from None
        self.checks["audit"] = "exactly once"
        assert "error" not in self.checkpoint, f"{context}last checkpoint: {self.checkpoint}"
        assert self.checkpoint.get("step") == self.shape.steps, (
            f"{context}last checkpoint: {self.checkpoint}")
        assert self.checkpoint.get("worst") == 0.0, (
            f"{context}the last checkpoint holds other weights: {self.checkpoint}")
        self.checks["checkpoint"] = f"step {self.checkpoint['step']} loads and verifies"
        assert not self.leftovers, f"{context}processes outlived their agent: {self.leftovers}"
        self.checks["processes"] = "none left"
        assert self.unclean is None, f"{context}{self.unclean}"
        self.checks["cluster"] = "clean"


class _Storage:
    """moto's S3 server in the observer's namespace, behind a fault proxy there."""

    def __init__(self, cluster: NetnsCluster, log: Path) -> None:
        observer = cluster.observer
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.server = observer.popen(
            [sys.executable, "-m", "moto.server", "-H", observer.address, "-p",
             str(_MOTO_PORT)], env={**os.environ, **_AWS}, stdout=self._log,
            stderr=subprocess.STDOUT)
        self.endpoint = f"http://{observer.address}:{_MOTO_PORT}"
        deadline = time.monotonic() + 60
        while not observer.call(_reachable, observer.address, _MOTO_PORT):
            if time.monotonic() > deadline or self.server.poll() is not None:
                raise RuntimeError(f"moto did not start in {observer.name}: "
                                   f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)
        self.proxy: FaultProxy = observer.call(FaultProxy, observer.address, _MOTO_PORT,
                                               listen_host=observer.address)
        self.bucket = f"chaos-{uuid.uuid4().hex[:10]}"
        observer.run([sys.executable, "-c",
                      "import sys, boto3; boto3.client('s3', endpoint_url=sys.argv[1])"
                      ".create_bucket(Bucket=sys.argv[2])", self.endpoint, self.bucket],
                     env={**os.environ, **_AWS}, timeout_s=120)

    def worker_env(self) -> dict[str, str]:
        """The workers reach S3 only through the proxy (botocore reads this variable)."""
        return {**_AWS, "AWS_ENDPOINT_URL_S3": self.proxy.endpoint}

    def close(self) -> None:
        self.proxy.close()
        proctree.kill_tree(self.server.pid)
        with suppress(subprocess.TimeoutExpired):
            self.server.wait(timeout=10)
        self._log.close()


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@dataclass
class _Slot:
    index: int
    host: Host
    launcher: Launcher | None = None
    ended: list[tuple[Launcher, str]] = field(default_factory=list)  # "killed" / "lost"


class NetnsChaosRun:
    """Runs one in-place job on a fresh namespace cluster under a scenario.

    Args:
        faults: The scenario.
        root: The run's directory (logs, audit, checkpoints, weights).
        reference: The undisturbed run's weights (:func:`reference_weights`).
        nodes: Node slots (agents at the start; ``--max-nodes``).
        shape: The training job.
        timeout: Seconds the whole run may take before it counts as hung.
        stall_timeout: Seconds without any new audit line, outside an injection, before the
            run counts as hung.
    """

    def __init__(self, faults: Sequence[NetnsFault], *, root: Path, reference: Path,
                 nodes: int = 3, shape: NetnsShape | None = None, timeout: float = 300.0,
                 stall_timeout: float = 90.0) -> None:
        if nodes < 1:
            raise ValueError(f"nodes ({nodes}) must be at least 1.")
        for fault in faults:
            if not 0 <= fault.node < nodes or not 0 <= fault.member < ETCD_MEMBERS:
                raise ValueError(f"fault {fault.describe()}: node must be in [0, {nodes}) "
                                 f"and member in [0, {ETCD_MEMBERS}).")
        self.faults = list(faults)
        self.root = root
        self.reference = reference
        self.nodes = nodes
        self.shape = shape or NetnsShape()
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.root.mkdir(parents=True, exist_ok=True)
        self._last_size = -1
        self._last_progress = time.monotonic()
        self._started = time.monotonic()
        self._first_step = time.monotonic()

    # -- the run -----------------------------------------------------------------------------

    def execute(self) -> NetnsRunResult:
        """Runs the job under the scenario; every process and namespace it made is gone on
        return."""
        from tests.support.netns_pytest import new_cluster

        self._started = time.monotonic()
        injected = [Injected(f) for f in self.faults]
        spares = sum(f.kind == "silent_host" for f in self.faults)
        result = NetnsRunResult(root=self.root, shape=self.shape, reference=self.reference,
                                injected=injected, exit_codes={}, wall_s=0.0)
        cluster = new_cluster(nodes=self.nodes + spares, etcd_members=ETCD_MEMBERS)
        try:
            with ExitStack() as stack:
                stack.enter_context(cluster)
                storage: _Storage | None = None
                if any(f.kind == "storage_outage" for f in self.faults):
                    storage = _Storage(cluster, self.root / "moto.log")
                    stack.callback(storage.close)
                self._run_job(cluster, storage, injected, result)
        except Exception as exc:  # the cluster itself failed: report it as this run's
            logger.exception("chaos run %s failed outside the job", self.root.name)
            result.unclean = result.unclean or f"{type(exc).__name__}: {exc}"
        try:
            cluster.assert_clean()
        except AssertionError as exc:
            result.unclean = str(exc)
        result.wall_s = time.monotonic() - self._started
        return result

    def _run_job(self, cluster: NetnsCluster, storage: _Storage | None,
                 injected: list[Injected[NetnsFault]], result: NetnsRunResult) -> None:
        checkpoint_url = (f"s3://{storage.bucket}/job" if storage is not None
                          else str(self.root / "ckpt"))
        script = inplace_worker_args(self.root, steps=self.shape.steps,
                                     step_time=self.shape.step_time,
                                     interval=self.shape.interval)
        script[script.index("--checkpoint-dir") + 1] = checkpoint_url
        job = NetnsJob(cluster, self.root, script,
                       env=storage.worker_env() if storage is not None else {},
                       job_id=f"chaos-{uuid.uuid4().hex[:8]}")
        self.job, self.cluster, self.storage = job, cluster, storage
        slots = [_Slot(i, cluster.nodes[i]) for i in range(self.nodes)]
        self._spares = list(cluster.nodes[self.nodes:])
        self._lost: list[Host] = []
        try:
            try:
                launchers = job.start_together(self._flags(), warm_up=0,
                                               hosts=[s.host for s in slots],
                                               timeout_s=min(180.0, self.timeout))
            except AssertionError as exc:
                result.startup = str(exc)[:3000]
                return
            for slot, launcher in zip(slots, launchers, strict=True):
                slot.launcher = launcher
            self._first_step = time.monotonic()
            try:
                self._drive(slots, injected)
            except TimeoutError as exc:
                result.hung = str(exc)
            result.exit_codes = self._exit_codes(slots)
            if result.hung is None:
                result.leftovers = self._leftovers(slots)
                result.checkpoint = self._verify_checkpoint(checkpoint_url)
        finally:
            hang.release_all(cluster.hang_file)
            result.logs = "\n".join(f"--- {la.log.name} ({la!r})\n{la.output()[-2500:]}"
                                    for la in job.launchers)
            job.stop()
            with suppress(Exception):
                from tests.integration.training.inplace_audit import read_audit

                audit = read_audit(job.audit_dir)
                result.worlds = [int(g["world"]) for g in sorted(
                    {int(g["gen"]): g for g in audit.gens}.values(), key=lambda g: g["gen"])]

    def _flags(self) -> tuple[str, ...]:
        return ("--min-nodes", "1", "--max-nodes", str(self.nodes))

    def _exit_codes(self, slots: list[_Slot]) -> dict[str, int | str]:
        codes: dict[str, int | str] = {}
        for slot in slots:
            for launcher, how in slot.ended:
                codes[launcher.log.name] = how
            if slot.launcher is not None:
                code = slot.launcher.returncode
                codes[slot.launcher.log.name] = "running" if code is None else code
        return codes

    def _leftovers(self, slots: list[_Slot]) -> list[str]:
        """Processes still inside the namespaces of nodes that were not lost, 15 s after
        their agents exited (an agent must take its workers with it)."""
        hosts = {s.host.name: s.host for s in slots}
        deadline = time.monotonic() + 15
        while True:
            left = {h.role: h.pids() for h in hosts.values()}
            left = {role: pids for role, pids in left.items() if pids}
            if not left or time.monotonic() > deadline:
                return [f"{role}: {pids}" for role, pids in left.items()]
            time.sleep(0.2)

    def _verify_checkpoint(self, url: str) -> dict[str, Any]:
        argv = [sys.executable, "-m", "tests.chaos.verify_checkpoint", url, "--weights",
                str(self.root / "weights.pt")]
        if self.storage is not None:
            argv += ["--endpoint-url", self.storage.endpoint]
        env = {**os.environ, **_AWS, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]),
                          os.environ.get("PYTHONPATH")]))}
        try:
            done = self.cluster.observer.run(argv, timeout_s=180, check=False, env=env,
                                             cwd=str(Path(__file__).resolve().parents[2]))
        except (subprocess.TimeoutExpired, TimeoutError) as exc:
            return {"error": f"verifying the checkpoint timed out ({exc})"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            return {"error": f"the verifier printed nothing (exit {done.returncode}): "
                             f"{done.stderr[-2000:]}"}
        parsed: dict[str, Any] = json.loads(lines[-1])
        return parsed

    # -- driving -----------------------------------------------------------------------------

    def _deadline_check(self, what: str) -> None:
        now = time.monotonic()
        size = sum(p.stat().st_size for p in self.job.audit_dir.glob("*.jsonl"))
        if size != self._last_size:
            self._last_size, self._last_progress = size, now
        if now - self._started > self.timeout:
            raise TimeoutError(f"{what} after {self.timeout:.0f} s")
        if now - self._last_progress > self.stall_timeout:
            raise TimeoutError(f"{what}: no step trained for {self.stall_timeout:.0f} s")

    def _latest_step(self) -> int:
        return int(self.job.latest_step(self.job.audit()))

    def _drive(self, slots: list[_Slot], injected: list[Injected[NetnsFault]]) -> None:
        for item in sorted(injected, key=lambda i: i.fault.at_step):
            fault = item.fault
            self.job.open_gate(min(self.shape.steps, fault.at_step + GATE_AHEAD))
            while self._latest_step() < fault.at_step:
                if all(s.launcher is None or s.launcher.returncode is not None for s in slots):
                    item.note = "every agent exited before the trigger"
                    break
                self._deadline_check(f"waiting to inject {fault.describe()}")
                time.sleep(_POLL_S)
            if item.note:
                continue
            item.at = round(time.monotonic() - self._first_step, 2)
            item.at_step = self._latest_step()
            logger.warning("chaos: %s (trained up to step %s)", fault.describe(), item.at_step)
            try:
                note = self._inject(fault, slots[fault.node])
            finally:
                self._last_progress = time.monotonic()  # an injection's own wait is no stall
            if note.startswith("ok"):
                item.note = note.removeprefix("ok").removeprefix(": ")
            else:
                item.at, item.note = None, note
        self.job.open_gate(self.shape.steps)
        while any(s.launcher is not None and s.launcher.returncode is None for s in slots):
            self._deadline_check("waiting for the job to finish")
            time.sleep(_POLL_S)

    def _worker(self, slot: _Slot) -> int | None:
        """The slot's newest worker (waits for one to be started)."""
        deadline = time.monotonic() + _WORKER_WAIT_S
        while True:
            launcher = slot.launcher
            pids = launcher.workers() if launcher is not None else []
            if pids:
                return pids[-1]
            if time.monotonic() > deadline or launcher is None \
                    or launcher.returncode is not None:
                return None
            self._deadline_check("waiting for a worker to fault")
            time.sleep(_POLL_S)

    def _restart(self, slot: _Slot, host: Host, after: float) -> None:
        time.sleep(after)
        slot.host = host
        slot.launcher = self.job.elastic_run(host, *self._flags())

    def _inject(self, fault: NetnsFault, slot: _Slot) -> str:
        kind, cluster = fault.kind, self.cluster
        if kind in ("kill_worker", "sigstop_worker", "hang_worker"):
            pid = self._worker(slot)
            if pid is None:
                return "no worker ran on the node"
            if kind == "kill_worker":
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return "ok"
            if kind == "sigstop_worker":
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(fault.duration)
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                return "ok"
            cluster.hang_worker(pid)
            # It hangs at its next step: let the job reach one.
            self.job.open_gate(min(self.shape.steps, self._latest_step() + 1 + GATE_AHEAD))
            started = time.monotonic()
            try:
                cluster.wait_hung(pid, 30.0)
                note = "ok"
            except (AssertionError, TimeoutError):
                note = "ok: it never reached its collective (it left or finished first)"
            time.sleep(max(0.0, fault.duration - (time.monotonic() - started)))
            cluster.release_worker(pid)
            return note
        if kind == "kill_node":
            assert slot.launcher is not None
            slot.ended.append((slot.launcher, "killed"))
            slot.launcher.kill()
            slot.launcher = None
            self._restart(slot, slot.host, fault.rejoin_after)
            return "ok"
        if kind == "silent_host":
            assert slot.launcher is not None
            cluster.cut_link(slot.host)
            slot.ended.append((slot.launcher, "lost"))
            self._lost.append(slot.host)
            slot.launcher = None
            self._restart(slot, self._spares.pop(0), fault.rejoin_after)
            return "ok"
        if kind in ("host_returns", "etcd_partition") and self._worker(slot) is None:
            # A node that has not joined yet is still probing etcd at start-up: cut off then,
            # it stops at once naming the endpoints (exit 3), as it must when they are wrong.
            return "the node never joined the job"
        if kind == "host_returns":
            cluster.cut_link(slot.host)
            time.sleep(fault.duration)
            cluster.restore_link(slot.host)
            return "ok"
        if kind == "etcd_partition":
            cluster.partition_from_etcd(slot.host)
            time.sleep(fault.duration)
            cluster.heal_from_etcd(slot.host)
            return "ok"
        if kind == "kill_etcd_member":
            member = cluster.etcd[fault.member]
            member.kill()
            time.sleep(fault.duration)
            member.start()
            return "ok"
        if kind == "pause_etcd":
            for member in cluster.etcd:
                member.pause()
            try:
                time.sleep(fault.duration)
            finally:
                for member in cluster.etcd:
                    member.resume()
            return "ok"
        assert kind == "storage_outage" and self.storage is not None
        before = self.storage.proxy.faulted
        self.storage.proxy.reset(fault.duration)
        time.sleep(fault.duration)
        self.storage.proxy.heal()
        return f"ok: {self.storage.proxy.faulted - before} S3 connections reset"


def summary(result: NetnsRunResult) -> dict[str, Any]:
    """One JSON-ready line about a run (for the campaign's log)."""
    return {
        "root": str(result.root), "wall_s": round(result.wall_s, 1),
        "faults": [{"fault": i.fault.describe(), "at_s": i.at, "trained_up_to": i.at_step,
                    "note": i.note} for i in result.injected],
        "worlds": result.worlds, "exit_codes": result.exit_codes, "checks": result.checks,
        "hung": result.hung,
    }
