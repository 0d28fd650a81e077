"""Helpers for the launcher integration tests: real ``elastic-run`` agents in their own sessions.

Every agent is a ``python -m launch`` subprocess started with ``start_new_session=True``; it is
killed by pid (the agent alone) or as a tree (the agent plus its workers, which torch starts in
sessions of their own). ``Cluster`` kills whatever is left when the test ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import proctree

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("allreduce_worker.py")

# Short rendezvous timeouts keep the suite fast on 2 cores; every key is a torch dynamic
# rendezvous key or one of our backend's documented keys.
FAST_RDZV_CONF = (
    "join_timeout=90,last_call_timeout=1,close_timeout=10,heartbeat_timeout=5,"
    "keep_alive_interval=1,keep_alive_max_attempt=3"
)


@dataclass(frozen=True)
class Step:
    rank: int
    world: int
    round: str
    step: int
    pid: int


def read_steps(path: Path) -> list[Step]:
    """Parse the ``rank,world,round,step,pid`` lines the workers appended."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split(",")
            if len(parts) == 5 and all(p.strip() for p in parts):
                try:
                    rows.append(Step(int(parts[0]), int(parts[1]), parts[2], int(parts[3]),
                                     int(parts[4])))
                except ValueError:
                    continue  # a line being written right now
    return rows


def wait_until(
    pred: Callable[[], bool], timeout: float, what: str,
    give_up: Callable[[], bool] = lambda: False,
) -> None:
    """Poll ``pred`` until true; fail naming ``what`` after ``timeout`` s or once ``give_up()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if give_up():
            raise AssertionError(f"every agent exited while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def workers(agent: Agent) -> list[int]:
    """The agent's live workers, oldest first: the children its log names as started workers
    (not its warm standbys, which are in :func:`tree`)."""
    from tests.support.proctree import workers as named_workers

    return named_workers(agent.pid, agent.output())


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out = [pid]
    for child in children(pid):
        out.extend(tree(child))
    return out


def alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill(pids: list[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


class Agent:
    """One ``elastic-run`` (or torchrun) agent process."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str],
                 cwd: Path = REPO, job_logs: Callable[[], str] | None = None) -> None:
        self.log = log
        # Every agent's log of the job: a hang is often another agent's doing (a peer that
        # restarted while this one waits in torch's exit barrier), so a timeout shows them all.
        self._job_logs = job_logs
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        return workers(self)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """Wait for the agent to exit; fail the test (and kill it) after ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            running = tree(self.pid)
            self.kill_tree()
            logs = self._job_logs() if self._job_logs else self.output()[-3000:]
            raise AssertionError(
                f"agent {self.pid} still running after {timeout:.0f} s (processes "
                f"{running}); the job's logs:\n{logs}"
            ) from None

    def kill_tree(self) -> None:
        """SIGKILLs the agent and every process under it, and returns once all are gone.

        A SIGKILLed process takes a moment to exit (its threads are torn down first); the
        agent, a child of the test, is reaped here, but a worker is not, and a busy host
        once showed one still running right after the signal."""
        pids = tree(self.pid)
        kill(pids)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        proctree.wait_gone(pids, 30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_tree()
        self._log_file.close()


class Cluster:
    """Agents of one job sharing one etcd; tracks and cleans up every process it starts."""

    def __init__(self, tmp: Path, endpoint: str, job_id: str) -> None:
        self.tmp = tmp
        self.endpoint = endpoint
        self.job_id = job_id
        self.out = tmp / "steps.csv"
        self.ckpt = tmp / "step.txt"
        self.agents: list[Agent] = []
        self.env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO")
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
        )

    def worker_args(self, *extra: str, steps: int = 60, step_time: float = 0.1) -> list[str]:
        return [str(WORKER), "--out", str(self.out), "--ckpt", str(self.ckpt), "--steps",
                str(steps), "--step-time", str(step_time), *extra]

    def start(self, launcher_args: list[str], worker_args: list[str],
              launcher: list[str] | None = None, cwd: Path = REPO) -> Agent:
        argv = [*(launcher or [sys.executable, "-m", "launch"]), *launcher_args, *worker_args]
        agent = Agent(argv, self.tmp / f"agent{len(self.agents)}.log", self.env, cwd,
                      job_logs=self.logs)
        self.agents.append(agent)
        return agent

    def start_elastic(self, *flags: str, worker_args: list[str]) -> Agent:
        return self.start(
            ["--etcd", self.endpoint, "--job-id", self.job_id, "--nproc-per-node", "1",
             "--rdzv-conf", FAST_RDZV_CONF, "--monitor-interval", "0.1", *flags],
            worker_args,
        )

    def all_exited(self) -> bool:
        return all(a.proc.poll() is not None for a in self.agents)

    def wait_for(self, pred: Callable[[list[Step]], bool], timeout: float, what: str) -> None:
        """Wait until ``pred(steps)`` holds; fail fast (with the logs) if every agent exited."""
        try:
            wait_until(lambda: pred(self.steps()), timeout, what, give_up=self.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def steps(self) -> list[Step]:
        return read_steps(self.out)

    def agent_of_pid(self, pid: int) -> Agent:
        for agent in self.agents:
            if pid in agent.worker_pids():
                return agent
        raise AssertionError(f"no agent owns worker pid {pid}")

    def logs(self) -> str:
        return "\n".join(f"--- {a.log.name}\n{a.output()[-4000:]}" for a in self.agents)

    def stop(self) -> None:
        for agent in self.agents:
            agent.stop()


@contextmanager
def cluster(tmp: Path, endpoint: str, job_id: str) -> Iterator[Cluster]:
    """A ``Cluster`` that kills every agent and worker it started when the block ends."""
    c = Cluster(tmp, endpoint, job_id)
    try:
        yield c
    finally:
        c.stop()


def etcd_or_skip(request: pytest.FixtureRequest) -> Any:
    """The shared ``etcd_server`` fixture of ``tests/conftest.py``: a running etcd, or the skip
    (a failure under ``ELASTIC_REQUIRE_ETCD=1``) that fixture gives where none is installed."""
    return request.getfixturevalue("etcd_server")
