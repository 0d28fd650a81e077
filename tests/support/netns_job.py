"""Real training jobs on a cluster of network namespaces: launch, fault, measure the stall.

:class:`NetnsJob` runs one job on a :class:`~tests.support.netns.NetnsCluster`: every node's
launcher (``elastic-run``, or ``torchrun`` for a comparison) runs inside that node's namespace,
where it finds the node's own address by itself, and etcd runs in namespaces of its own. The
launchers get only what a user on a real host would pass: the node counts, the etcd endpoints
and the job id (plus the script's own arguments). In particular no ``GLOO_SOCKET_IFNAME`` and
no ``--local-addr``: elastic-run must find the interface that reaches etcd on its own (the
processes of a namespace share the machine's hostname, which resolves to an address of the
root namespace, so anything dialled by hostname would go wrong here).

The training script writes the per-sample audit (``tests/integration/training/inplace_audit``:
``pid<PID>.jsonl`` files with ``gen``, ``batch`` and ``done`` records, each ``done`` with its
wall-clock time), from which a test checks exactly-once training and reads the stall:

* :func:`inplace_worker_args` runs ``tests/integration/training/inplace_worker.py`` (the
  explicit loop, float64, with the hang hook :func:`tests.support.hang.maybe_hang` before each
  step's collective, a gate file that can hold the job at a step, and ``--weights-out``);
* :func:`example_args` runs ``examples/train.py`` as the README gives it (float64, the managed
  loop's audit through ``ELASTIC_SAMPLE_AUDIT``).

Faults go through :meth:`NetnsJob.fault`, which records when (``time.time()``, the clock of the
audit) and in which generation it struck, and which worker processes it hit; :func:`stall`
then measures, from the survivors' own step timestamps, the time from the fault to the
moment every survivor has completed a step in a newer world. The same objects serve the
namespace tests and benchmarks (many runs, torchrun alongside: a torchrun
job's workers write the same audit when they run ``examples/train.py`` with
``ELASTIC_SAMPLE_AUDIT``; its stall is then read with ``restarted=True``).

Example (a silent host, the survivors' stall)::

    with NetnsCluster(nodes=3, etcd_members=1) as cluster:
        root = tmp_path / "job"
        job = NetnsJob(cluster, root, inplace_worker_args(root, steps=120))
        agents = job.start_together(("--min-nodes", "2", "--max-nodes", "3"))
        job.run_ahead(40)                     # the gate lets 40 more steps run
        victim = job.node_of_rank(0)
        fault = job.fault("silent host", victim, lambda: cluster.cut_link(victim))
        job.wait_moved_on(fault)
        print(stall(job.audit(), fault))
        job.stop()
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.support import proctree
from tests.support.netns import Host, NetnsCluster

REPO: Final = Path(__file__).resolve().parents[2]
INPLACE_WORKER: Final = REPO / "tests" / "integration" / "training" / "inplace_worker.py"
EXAMPLE: Final = REPO / "examples" / "train.py"
#: What a job of :func:`inplace_worker_args` trains on (the audit needs them).
GLOBAL_BATCH: Final = 12
#: Divides every share of the global batch on 1, 2, 3, 4 or 6 ranks (the worker's loader has
#: a fixed batch size, so each share must split into equal micro-batches).
MICRO_BATCH: Final = 2
DATASET: Final = 100
SEED: Final = 11
#: ``examples/train.py``'s defaults (its audit needs them).
EXAMPLE_GLOBAL_BATCH: Final = 64
EXAMPLE_DATASET: Final = 8192
EXAMPLE_SEED: Final = 1234
#: Variables of the developer's shell that would change what a user's launcher does.
_SCRUBBED: Final = ("ELASTIC_MODE", "ELASTIC_ETCD_ENDPOINTS", "ELASTIC_RUN_ID",
                    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ELASTIC_INPLACE_TTL",
                    "ELASTIC_HANG_TIMEOUT", "ELASTIC_HANG_FACTOR", "PET_MAX_RESTARTS")
_POLL_S: Final = 0.1


def inplace_worker_args(root: Path, *, steps: int = 40, step_time: float = 0.05,
                        interval: int = 5) -> list[str]:
    """The script and arguments of an ``inplace_worker.py`` job writing under ``root``.

    Its checkpoints go to ``root/ckpt``, its audit to ``root/audit``, the final weights (from
    the world's rank 0) to ``root/weights.pt``; ``root/gate`` holds steps (see
    :meth:`NetnsJob.open_gate`; no file: no hold).
    """
    return [str(INPLACE_WORKER), "--checkpoint-dir", str(root / "ckpt"),
            "--audit-dir", str(root / "audit"), "--steps", str(steps),
            "--interval", str(interval), "--global-batch", str(GLOBAL_BATCH),
            "--micro-batch", str(MICRO_BATCH), "--dataset-size", str(DATASET),
            "--step-time", str(step_time), "--gate-file", str(root / "gate"),
            "--weights-out", str(root / "weights.pt")]


def plain_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment scrubbed of settings a user's shell would not have, with
    the repository importable and one thread per worker."""
    values = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    values["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    values.update(OMP_NUM_THREADS="1", LOGLEVEL=values.get("LOGLEVEL", "INFO"),
                  PYTHONUNBUFFERED="1", **(extra or {}))
    return values


def undisturbed_run(root: Path, *, steps: int, timeout_s: float = 120.0) -> Path:
    """Runs the :func:`inplace_worker_args` job undisturbed: one process, no launcher, no
    step time, on loopback (``env://``, a world of one). Returns its final weights' path.

    The job's optimisation does not depend on the world size (the global batch is fixed,
    float64), so its weights are what any disturbed run of the same steps must end with.

    Raises:
        AssertionError: with its output, if it fails.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = plain_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                     "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)})
    argv = [sys.executable, *inplace_worker_args(root, steps=steps, step_time=0.0)]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    assert done.returncode == 0, f"the undisturbed run failed:\n{done.stdout[-3000:]}" \
        f"{done.stderr[-3000:]}"
    return root / "weights.pt"


def example_args(root: Path, *, steps: int = 200, step_time: float = 0.05) -> list[str]:
    """``examples/train.py`` in float64 with checkpoints under ``root/ckpt`` (add
    :func:`example_env` to the job's environment for its audit)."""
    return [str(EXAMPLE), "--dtype", "float64", "--steps", str(steps),
            "--step-time", str(step_time), "--checkpoint-dir", str(root / "ckpt")]


def example_env(root: Path) -> dict[str, str]:
    """The environment that makes ``examples/train.py`` write its audit to ``root/audit``."""
    return {"ELASTIC_SAMPLE_AUDIT": str(root / "audit")}


class Launcher:
    """One launcher process (``elastic-run`` or ``torchrun``) inside a node's namespace.

    Attributes:
        host: The node it runs on.
        argv: Its command line.
        log: Its stdout and stderr (its workers' too: they inherit them).
        proc: The process (its PID is the launcher's own; it leads its own session).
    """

    def __init__(self, host: Host, argv: Sequence[str], env: Mapping[str, str],
                 log: Path) -> None:
        self.host = host
        self.argv = list(argv)
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.started_at = time.time()
        self.proc = host.popen(self.argv, env=env, cwd=REPO, stdout=self._log_file,
                               stderr=subprocess.STDOUT)

    def __repr__(self) -> str:
        return f"Launcher({self.host.role}, pid={self.pid}, rc={self.proc.poll()})"

    @property
    def pid(self) -> int:
        """The launcher's PID."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Its exit code once it exited."""
        return self.proc.poll()

    def workers(self) -> list[int]:
        """Its live worker processes (its children but waiting standbys), oldest first."""
        return proctree.workers(self.pid, self.output())

    def worker(self, timeout_s: float = 60.0) -> int:
        """Its one worker's PID (waits for it to be started)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.workers()
            if len(pids) == 1:
                return pids[0]
            if time.monotonic() > deadline or self.returncode is not None:
                raise AssertionError(f"{self!r} has workers {pids}, expected one; log tail:\n"
                                     f"{self.output()[-3000:]}")
            time.sleep(_POLL_S)

    def output(self) -> str:
        """What it (and its workers) printed so far."""
        self._log_file.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        """Waits for it to exit; kills its tree and fails after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self!r} still running after {timeout_s:.0f} s; log tail:\n"
                                 f"{self.output()[-4000:]}") from None

    def kill(self) -> None:
        """SIGKILLs it and its whole tree (its workers lead sessions of their own)."""
        proctree.kill_tree(self.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Kills what is left and closes the log."""
        if self.proc.poll() is None or proctree.descendants(self.pid):
            self.kill()
        self._log_file.close()


@dataclass(frozen=True)
class Fault:
    """One fault, as a stall measurement needs it.

    Attributes:
        kind: What it was (``"silent host"``, ``"sigstop"``, ...).
        node: The namespace role of the node it hit (``"n2"``).
        t: When (``time.time()``, the clock of the audit's ``done`` records).
        gen: The newest generation any worker had started training in at that moment.
        hit: Worker PIDs the fault hit (their own stall is not the survivors').
        survivors: Worker PIDs of the job that it did not hit (alive at that moment).
    """

    kind: str
    node: str
    t: float
    gen: int
    hit: frozenset[int]
    survivors: frozenset[int]


@dataclass
class NetnsJob:
    """One training job on a namespace cluster (see the module docstring).

    Args:
        cluster: A started cluster with at least one etcd member.
        root: A directory for the job's logs, checkpoints and audit (created).
        script: The script and its arguments (:func:`inplace_worker_args`, ...).
        env: Extra environment of every launcher (and so of every worker).
        job_id: The job id (a fresh one by default).
    """

    cluster: NetnsCluster
    root: Path
    script: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    job_id: str = field(default_factory=lambda: f"netns-{uuid.uuid4().hex[:8]}")
    launchers: list[Launcher] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.audit_dir.mkdir(parents=True, exist_ok=True)

    # ---- paths ---------------------------------------------------------------------------

    @property
    def audit_dir(self) -> Path:
        """Where the workers write their audit."""
        return self.root / "audit"

    @property
    def checkpoint_dir(self) -> Path:
        """Where the job's checkpoints go."""
        return self.root / "ckpt"

    @property
    def weights(self) -> Path:
        """The final weights (``inplace_worker.py``'s ``--weights-out``)."""
        return self.root / "weights.pt"

    @property
    def gate(self) -> Path:
        """``inplace_worker.py``'s gate file."""
        return self.root / "gate"

    def open_gate(self, up_to: int) -> None:
        """Lets ``inplace_worker.py`` run the steps below ``up_to``, holding the others (a
        worker waiting to be admitted is let through to the next boundary)."""
        tmp = self.gate.with_name(".gate.tmp")
        tmp.write_text(str(up_to))
        os.replace(tmp, self.gate)

    # ---- launching -----------------------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        """Every launcher's environment: :func:`plain_env` with the cluster's hang file and
        the job's ``env``."""
        return plain_env({**self.cluster.hang_env(), **self.env})

    def launch(self, host: Host, argv: Sequence[str],
               env: Mapping[str, str] | None = None) -> Launcher:
        """Starts any launcher command inside ``host`` (logged to ``root``)."""
        log = self.root / f"{host.role}-{len(self.launchers)}.log"
        launcher = Launcher(host, argv, {**self.base_env(), **(env or {})}, log)
        self.launchers.append(launcher)
        return launcher

    def elastic_run(self, host: Host, *flags: str) -> Launcher:
        """``elastic-run FLAGS --etcd <members> --job-id <id> SCRIPT...`` inside ``host``.

        ``flags`` are the user's node counts (``--min-nodes 2 --max-nodes 3``, ``--nnodes
        3``) and anything else the test means to pass; nothing else is added.
        """
        argv = [sys.executable, "-m", "launch", *flags, "--etcd",
                self.cluster.etcd_endpoints, "--job-id", self.job_id, *self.script]
        return self.launch(host, argv)

    def torchrun(self, host: Host, *flags: str, rdzv_host: Host, rdzv_port: int = 29400,
                 rdzv_conf: str = "") -> Launcher:
        """``torchrun`` with torch's c10d rendezvous hosted by ``rdzv_host``, inside ``host``.

        torchrun needs what its users must give it on such hosts: the rendezvous endpoint;
        ``is_host=1`` on the node that hosts the store (its agent recognises itself by the
        hostname's addresses, which belong to the root namespace here: without it nobody
        hosts the store and every agent fails after 60 s); ``--local-addr``, so that its
        agent advertises the node's address; and ``GLOO_SOCKET_IFNAME`` (gloo otherwise
        binds the address the shared hostname resolves to).
        """
        conf = ",".join(filter(None, [rdzv_conf, "is_host=1" if host is rdzv_host else ""]))
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{rdzv_host.address}:{rdzv_port}", "--rdzv-id",
                self.job_id, "--local-addr", host.address,
                *(("--rdzv-conf", conf) if conf else ()), *flags, *self.script]
        return self.launch(host, argv, {"GLOO_SOCKET_IFNAME": host.ifname})

    def on(self, host: Host) -> list[Launcher]:
        """The launchers started on ``host``, oldest first."""
        return [launcher for launcher in self.launchers if launcher.host is host]

    def workers(self) -> dict[int, Host]:
        """Every live worker PID of the job, with its node."""
        return {pid: launcher.host for launcher in self.launchers
                if launcher.returncode is None for pid in launcher.workers()}

    # ---- watching ------------------------------------------------------------------------

    def audit(self) -> Any:
        """The audit so far (:class:`~tests.integration.training.inplace_audit.Audit`)."""
        from tests.integration.training.inplace_audit import read_audit

        return read_audit(self.audit_dir)

    def all_exited(self) -> bool:
        """Whether every launcher has exited."""
        return all(launcher.returncode is not None for launcher in self.launchers)

    def wait_for(self, predicate: Callable[[Any], Any], what: str,
                 timeout_s: float = 90.0) -> Any:
        """Waits until ``predicate(audit)`` is truthy and returns it; fails with the logs
        after ``timeout_s`` or once every launcher has exited."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = predicate(self.audit())
            if found:
                return found
            if self.all_exited():
                raise AssertionError(f"every launcher exited while waiting for {what}\n"
                                     f"{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n"
                                     f"{self.logs()}")
            time.sleep(_POLL_S)

    @staticmethod
    def newest_gen(audit: Any) -> int:
        """The newest generation any worker started training in (-1 before the first)."""
        return max((int(g["gen"]) for g in audit.gens), default=-1)

    @staticmethod
    def trained_in_world(audit: Any, size: int, *, after_gen: int = -1,
                         min_step: int = 0) -> int | None:
        """The newest generation after ``after_gen`` of ``size`` ranks in which a step at or
        past ``min_step`` completed, or ``None``."""
        sizes = {int(g["gen"]): int(g["world"]) for g in audit.gens}
        hits = [int(d["gen"]) for d in audit.done
                if int(d["gen"]) > after_gen and sizes.get(int(d["gen"])) == size
                and int(d["step"]) >= min_step]
        return max(hits) if hits else None

    @staticmethod
    def latest_step(audit: Any) -> int:
        """The highest step any worker completed (-1 before the first)."""
        return max((int(d["step"]) for d in audit.done), default=-1)

    def start_together(self, flags: Sequence[str], *, warm_up: int = 8,
                       hosts: Sequence[Host] | None = None, timeout_s: float = 150.0
                       ) -> list[Launcher]:
        """Starts ``elastic-run FLAGS`` on every node (or ``hosts``) of an
        ``inplace_worker.py`` job and returns once they all trained together past step
        ``warm_up`` (the gate holds step 0 until every node's worker is in the world, then
        the job holds at ``warm_up + 1``: open the gate further with :meth:`run_ahead`)."""
        nodes = list(hosts if hosts is not None else self.cluster.nodes)
        self.open_gate(0)
        launchers = [self.elastic_run(node, *flags) for node in nodes]
        self.wait_for(lambda a: (g := self.newest_gen(a)) >= 0 and a.world_of(g) == len(nodes)
                      and len(a.pids_by_gen()[g]) == len(nodes), f"a world of {len(nodes)}",
                      timeout_s)
        self.open_gate(warm_up + 1)
        self.wait_for(lambda a: self.latest_step(a) >= warm_up, f"step {warm_up}", timeout_s)
        return launchers

    def run_ahead(self, steps: int, limit: int | None = None) -> None:
        """Lets an ``inplace_worker.py`` job run ``steps`` more steps than it has completed
        (never past ``limit``), then hold."""
        target = self.latest_step(self.audit()) + 1 + steps
        self.open_gate(target if limit is None else min(limit, target))

    def wait_world(self, size: int, after_gen: int, what: str,
                   accept: Callable[[set[int]], bool] = lambda _pids: True,
                   timeout_s: float = 150.0) -> int:
        """Waits for a world of ``size`` workers newer than ``after_gen`` whose workers have
        all entered their loop, and whose worker pids ``accept`` takes; returns its
        generation."""
        found: int = self.wait_for(
            lambda a: (g := self.newest_gen(a)) > after_gen and a.world_of(g) == size
            and len(a.pids_by_gen()[g]) == size and accept(a.pids_by_gen()[g]) and g,
            what, timeout_s)
        return found

    def wait_moved_on(self, fault: Fault, timeout_s: float = 150.0) -> None:
        """Waits until a survivor of ``fault`` completed a step in a newer world."""
        self.wait_for(lambda a: any(int(d["pid"]) in fault.survivors
                                    and int(d["gen"]) > fault.gen for d in a.done),
                      f"the survivors of the {fault.kind} to train on", timeout_s)

    def node_of_rank(self, rank: int = 0) -> Host:
        """The node whose worker holds ``rank`` in the newest world any worker trains in."""
        audit = self.audit()
        gen = self.newest_gen(audit)
        pids = [int(g["pid"]) for g in audit.gens
                if int(g["gen"]) == gen and int(g["rank"]) == rank]
        hosts = self.workers()
        for pid in pids:
            if pid in hosts:
                return hosts[pid]
        raise AssertionError(f"no live worker holds rank {rank} of generation {gen}")

    # ---- faults --------------------------------------------------------------------------

    def fault(self, kind: str, host: Host, action: Callable[[], Any],
              hit: Iterable[int] | None = None) -> Fault:
        """Runs ``action`` (the fault) and records it.

        Args:
            kind: A name for reports.
            host: The node it hits.
            action: What injects it (``lambda: cluster.cut_link(node)``, ...).
            hit: The worker PIDs it hits (default: every worker on ``host``).
        """
        workers = self.workers()
        victims = frozenset(hit if hit is not None
                            else (pid for pid, node in workers.items() if node is host))
        gen = self.newest_gen(self.audit())
        t = time.time()
        action()
        fault = Fault(kind, host.role, t, gen, victims, frozenset(workers) - victims)
        self.faults.append(fault)
        return fault

    # ---- ending --------------------------------------------------------------------------

    def wait_launchers(self, launchers: Iterable[Launcher], timeout_s: float = 90.0
                       ) -> list[int]:
        """Waits for ``launchers`` to exit; returns their exit codes (fails with the logs)."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for launcher in launchers:
            try:
                codes.append(launcher.wait(max(1.0, deadline - time.monotonic())))
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{self.logs()}") from None
        return codes

    def logs(self, tail: int = 6000) -> str:
        """The end of every launcher's log."""
        return "\n".join(f"--- {launcher.log.name} ({launcher!r})\n{launcher.output()[-tail:]}"
                         for launcher in self.launchers)

    def stop(self) -> None:
        """Kills every launcher's tree that is left (and any process left in the job's
        nodes' namespaces: a worker whose launcher died leaves its tree)."""
        for launcher in self.launchers:
            launcher.stop()
        for host in {launcher.host.name: launcher.host for launcher in self.launchers}.values():
            host.kill_all(signal.SIGKILL)
        proctree.wait_gone([p for h in self.cluster.nodes for p in h.pids()], 10.0)


def stall(audit: Any, fault: Fault, *, restarted: bool = False) -> float:
    """Seconds from ``fault`` until training went on without what it hit.

    Read from the workers' own ``done`` records. A step completed just after a fault may be
    the one that was in flight (the lost member had already done its part of the
    collective), so only steps of a *newer world* count:

    * in place (the default): for each survivor (:attr:`Fault.survivors`), its first step
      completed in a generation newer than the fault's; the stall is the latest of those. A
      survivor that never completed one counts as ``inf``.
    * ``restarted=True``, for launchers that restart every worker (torchrun, elastic-run's
      restart mode: the survivors are new processes, and under torchrun every generation
      is 0): the first step completed after the fault by a worker process that did not
      exist at the fault, or in a newer generation.

    Raises:
        ValueError: If the fault had no survivors (in place).
    """
    if restarted:
        old = fault.survivors | fault.hit
        times = [float(d["t"]) for d in audit.done if float(d["t"]) > fault.t
                 and (int(d.get("pid", -1)) not in old or int(d["gen"]) > fault.gen)]
        return (min(times) if times else float("inf")) - fault.t
    if not fault.survivors:
        raise ValueError(f"fault {fault.kind!r} on {fault.node} had no survivors to measure.")
    firsts = []
    for pid in fault.survivors:
        times = [float(d["t"]) for d in audit.done
                 if int(d.get("pid", -1)) == pid and float(d["t"]) > fault.t
                 and int(d["gen"]) > fault.gen]
        firsts.append(min(times) if times else float("inf"))
    return max(firsts) - fault.t


def commits(checkpoint_dir: Path) -> list[dict[str, Any]]:
    """Every committed checkpoint under ``checkpoint_dir``: its ``COMMIT.json`` records (with
    the directory's name as ``dir``), oldest first."""
    found = []
    for marker in sorted(checkpoint_dir.glob("*/COMMIT.json")):
        record = json.loads(marker.read_text())
        record["dir"] = marker.parent.name
        found.append(record)
    return sorted(found, key=lambda r: float(r.get("created_at", 0.0)))


def log_lines(text: str, pattern: str) -> list[str]:
    """Lines of ``text`` matching the regular expression ``pattern``."""
    regex = re.compile(pattern)
    return [line for line in text.splitlines() if regex.search(line)]


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of a process, as its network namespace's ``/proc/<pid>/net/tcp``
    shows it."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: str  # "LISTEN", "ESTABLISHED", ... (the kernel's names)


_TCP_STATES: Final = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV",
                      "04": "FIN_WAIT1", "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE",
                      "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def _hex_endpoint(text: str) -> tuple[str, int]:
    address, port = text.split(":")
    return ".".join(str(b) for b in reversed(bytes.fromhex(address))), int(port, 16)


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """The IPv4 TCP sockets process ``pid`` holds open, seen from its own namespace."""
    owned = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owned.add(target[8:-1])
    found = []
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[9] in owned:
                found.append(TcpSocket(_hex_endpoint(fields[1]), _hex_endpoint(fields[2]),
                                       _TCP_STATES.get(fields[3], fields[3])))
    return found


def environ_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    with open(f"/proc/{pid}/environ", "rb") as raw:
        items = raw.read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def current_world(cluster: NetnsCluster, job_id: str, key_prefix: str = "/elastic") -> Any:
    """The job's current world record (:class:`~elastic.contract.records.WorldRecord`), read
    from etcd through the observer, or ``None``."""
    from elastic.contract.records import WorldRecord

    newest: tuple[int, Any] | None = None
    for kv in cluster.etcd_client().get_prefix(f"{key_prefix}/{job_id}/"):
        match = re.search(r"/g(\d+)/job/world$", kv.key)
        if match and (newest is None or int(match[1]) > newest[0]):
            newest = (int(match[1]), WorldRecord.loads(kv.value, kv.key,
                                                       revision=kv.mod_revision))
    return newest[1] if newest else None
