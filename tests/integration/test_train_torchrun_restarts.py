"""The plain torchrun script (``examples/train_torchrun.py``) under both launchers.

* Under ``elastic-run`` (restart mode, 3 nodes on 127.0.0.1, one real etcd, default flags): a
  worker is SIGKILLed, then a whole node's process tree; the job finishes on 2 nodes. The
  restarted workers ran in warm standbys (their processes were started before the fault, and
  the agent logged the start as warm), and the final weights equal an undisturbed one-process
  run's (float64: the script's global batch and sample order do not depend on the world size).
* Under ``elastic-run --warm-standby off --memory-checkpoints off`` (one node, two workers): no
  standby is ever started, the workers are told of no memory store, a killed worker's world
  restarts in fresh processes, and the weights still equal the undisturbed run's.
* Under ``torchrun``: 2 workers train and checkpoint, then 1 worker resumes from the script's
  own newest checkpoint and finishes with the same weights.

The restart times themselves are measured by ``benchmarks/restart_path.py``, not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import (
    REPO,
    Cluster,
    cluster,
    etcd_or_skip,
    kill,
    tree,
    wait_until,
    workers,
)

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

SCRIPT = REPO / "examples" / "train_torchrun.py"
STEPS = 500
COMMON = ("--dtype", "float64", "--checkpoint-every", "10")
EVENT_TIMEOUT = 120.0


def _timing(directory: Path) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for path in directory.glob("rank*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()
                   if line.strip().endswith("}")]
        if records:
            out[int(records[0]["pid"])] = records
    return out


def _stepping(directory: Path, world: int, after: float) -> dict[int, list[dict[str, Any]]]:
    """Workers that completed a step in a world of ``world`` after ``after``."""
    return {pid: recs for pid, recs in _timing(directory).items()
            if any(r["event"] == "step" and r["world"] == world and r["time"] > after
                   for r in recs)}


def _reference(tmp: Path, out: Path, steps: int) -> dict[str, torch.Tensor]:
    """The undisturbed run: one process, a world of one."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--checkpoint-dir", str(tmp / "reference-ckpt"),
         "--steps", str(steps), *COMMON, "--weights-out", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(torch.load(out, weights_only=True))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-9, f"final weights differ from the undisturbed run's by {worst}"


class Job:
    def __init__(self, c: Cluster, root: Path, nodes: int = 3,
                 flags: tuple[str, ...] = ("--nnodes", "2:3", "--nproc-per-node", "1")
                 ) -> None:
        self.c = c
        self.timing = root / "timing"
        self.events = root / "events"
        self.weights = root / "weights.pt"
        args = [str(SCRIPT), "--checkpoint-dir", str(root / "ckpt"), "--steps", str(STEPS),
                *COMMON, "--step-time", "0.03", "--timing-log", str(self.timing),
                "--weights-out", str(self.weights)]
        argv = ["--etcd", c.endpoint, "--job-id", c.job_id, *flags,
                "--events-dir", str(self.events)]
        self.agents = [c.start(argv, args) for _ in range(nodes)]

    def wait_world(self, world: int, after: float, old: set[int]) -> dict[int, Any]:
        found: dict[int, Any] = {}

        def check() -> bool:
            found.clear()
            found.update({p: r for p, r in _stepping(self.timing, world, after).items()
                          if p not in old})
            return len(found) >= world

        try:
            wait_until(check, EVENT_TIMEOUT, f"{world} new workers stepping",
                       give_up=self.c.all_exited)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.c.logs()}") from None
        return found

    def worker_of(self, index: int) -> int:
        (pid,) = workers(self.agents[index])
        return pid

    def wait_standbys(self, indexes: list[int]) -> None:
        """Until each of these nodes has its next standby (started a few seconds after a
        restart; it may still be importing, and a world handed to it waits for that)."""
        from launch.standby import is_standby

        wait_until(lambda: all(any(is_standby(p) for p in tree(self.agents[i].pid))
                               for i in indexes), EVENT_TIMEOUT,
                   "every live node to have a standby", give_up=self.c.all_exited)

    def first_starts_after(self, after: float) -> dict[str, bool]:
        """Per agent (event log node), whether its first worker start after ``after`` was
        warm."""
        first: dict[str, tuple[float, bool]] = {}
        for path in self.events.glob("*.agent.*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record["event"] != "workers_started" or record["time"] <= after:
                    continue
                seen = first.get(record["node"])
                if seen is None or record["time"] < seen[0]:
                    first[record["node"]] = (record["time"], bool(record.get("warm")))
        return {node: warm for node, (_, warm) in first.items()}


@pytest.fixture(scope="module")
def etcd(request: pytest.FixtureRequest) -> Any:
    return etcd_or_skip(request)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The undisturbed run's final weights after ``STEPS`` steps (one process)."""
    root = tmp_path_factory.mktemp("reference")
    return _reference(root, root / "weights.pt", STEPS)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory, etcd: Any) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("train-torchrun")
    with cluster(root, etcd.endpoint, f"plain-{uuid.uuid4().hex[:8]}") as c:
        job = Job(c, root)
        first = job.wait_world(3, 0.0, set())
        job.wait_standbys([0, 1, 2])
        # 1. SIGKILL node 1's worker.
        victim = job.worker_of(1)
        before = set(first)
        worker_kill = time.time()
        kill([victim])
        after_worker = job.wait_world(3, worker_kill, before)
        # 2. Once every node has its next standby, SIGKILL node 2's whole process tree.
        job.wait_standbys([0, 1, 2])
        lost = tree(job.agents[2].pid)
        node_kill = time.time()
        kill(lost)
        after_node = job.wait_world(2, node_kill, before | set(after_worker))
        for agent in job.agents[:2]:
            assert agent.wait(240) == 0, c.logs()
        yield {"job": job, "worker_kill": worker_kill, "node_kill": node_kill,
               "after_worker": after_worker, "after_node": after_node, "root": root}


@pytest.mark.timeout(420)  # includes the module fixture: a 500-step job and two faults
def test_worker_and_node_kills_end_with_the_undisturbed_weights(
    restarted: dict[str, Any], reference: dict[str, torch.Tensor],
) -> None:
    job: Job = restarted["job"]
    _assert_same_weights(dict(torch.load(job.weights, weights_only=True)), reference)
    last = max(r["step"] for recs in _timing(job.timing).values()
               for r in recs if r["event"] == "step")
    assert last == STEPS


@pytest.mark.timeout(60)
def test_the_restarted_workers_ran_in_standbys_started_before_each_fault(
    restarted: dict[str, Any],
) -> None:
    job: Job = restarted["job"]
    for fault, found in (("worker_kill", restarted["after_worker"]),
                         ("node_kill", restarted["after_node"])):
        killed_at = restarted[fault]
        for pid, records in found.items():
            started = records[0]
            # The process existed before the fault: the standby, handed the new world.
            assert started["process_started"] < killed_at, (fault, pid, started)
    # The agents' side: each node's first start after each fault was in its standby.
    after_worker = job.first_starts_after(restarted["worker_kill"])
    assert len(after_worker) == 3 and all(after_worker.values()), after_worker
    after_node = job.first_starts_after(restarted["node_kill"])
    assert len(after_node) == 2 and all(after_node.values()), after_node


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


@pytest.mark.timeout(300)
def test_with_both_caches_off_a_restart_starts_fresh_workers_and_keeps_the_weights(
    tmp_path: Path, etcd: Any, reference: dict[str, torch.Tensor],
) -> None:
    from checkpointing.memory_tier import MEMORY_STORE_ENV
    from launch.standby import is_standby

    with cluster(tmp_path, etcd.endpoint, f"cold-{uuid.uuid4().hex[:8]}") as c:
        job = Job(c, tmp_path, nodes=1, flags=(
            "--nnodes", "1", "--nproc-per-node", "2", "--warm-standby", "off",
            "--memory-checkpoints", "off"))
        (agent,) = job.agents
        first = job.wait_world(2, 0.0, set())
        for pid in first:
            assert MEMORY_STORE_ENV not in _environ(pid), "memory store told to a worker"
        wait_until(lambda: any((tmp_path / "ckpt").glob("step-*.pt")), EVENT_TIMEOUT,
                   "a first checkpoint", give_up=c.all_exited)
        victim = min(first)
        killed_at = time.time()
        kill([victim])
        after = job.wait_world(2, killed_at, set(first))
        assert not [p for p in tree(agent.pid) if is_standby(p)], "a standby was started"
        for pid, records in after.items():
            # A fresh process: started after the fault, not a standby started before it.
            assert records[0]["process_started"] > killed_at, (pid, records[0])
        assert job.first_starts_after(killed_at) and not any(
            job.first_starts_after(killed_at).values())
        assert agent.wait(240) == 0, c.logs()
    resumed = [r for recs in after.values() for r in recs if r["event"] == "loaded"]
    assert resumed and all(r["step"] >= 10 for r in resumed), resumed
    _assert_same_weights(dict(torch.load(job.weights, weights_only=True)), reference)


@pytest.mark.timeout(240)
def test_the_script_resumes_its_own_checkpoint_under_torchrun_on_another_world_size(
    tmp_path: Path, reference: dict[str, torch.Tensor],
) -> None:
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)

    def torchrun(nproc: int, steps: int, *extra: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(nproc), str(SCRIPT), "--checkpoint-dir", str(ckpt), "--steps", str(steps),
             *COMMON, *extra], env=env, capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stderr[-3000:]

    torchrun(2, 25)  # checkpoints at steps 10 and 20; the last 5 steps are lost
    assert sorted(p.name for p in ckpt.glob("step-*.pt")) == ["step-00000010.pt",
                                                               "step-00000020.pt"]
    assert not list(ckpt.glob("*.tmp"))
    torchrun(1, STEPS, "--weights-out", str(tmp_path / "w.pt"), "--timing-log",
             str(tmp_path / "timing"))
    (records,) = _timing(tmp_path / "timing").values()
    assert next(r for r in records if r["event"] == "loaded")["step"] == 20
    _assert_same_weights(dict(torch.load(tmp_path / "w.pt", weights_only=True)), reference)
