"""etcd paused past the lease TTL: every node's lease expires, and the job trains on in place.

Issue 25, fault 2 under ``elastic-run``: an expired lease is a normal event (etcd stalled, a
long pause), and every node still holds the job's state. The agents used to stop their
workers and restart them from the last checkpoint. Now each node takes a new lease and joins
again under the same id; its workers keep their processes, are admitted again if the worlds
moved on meanwhile, and heal from each other, without reading a checkpoint.

Two ``elastic-run`` agents in place (``--nnodes 1:2``, TTL 3 s) on an etcd of their own, which
is SIGSTOPped for 5 s while they train. Checks: etcd really dropped a lease (an agent says
so); the workers that trained before the pause are the ones that finish (no process was
restarted); no worker read storage after the pause; checkpoints are committed again once the
nodes are back (their commits are fenced only while their leases are not fresh); every sample
is trained exactly once; both agents exit 0.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import cluster
from tests.integration.training.inplace_audit import check_exactly_once
from tests.integration.training.inplace_job import DATASET, GLOBAL_BATCH, SEED, InPlaceJob
from tests.support.netns_job import commits

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 200
STEP_TIME = 0.05
TTL = 3
PAUSE_S = 5.0


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[Any]:
    """An etcd of this test's own: pausing the shared one would stall other tests."""
    from launch.etcd_server import EmbeddedEtcd, EtcdBinaryNotFoundError

    server = EmbeddedEtcd(data_dir=str(tmp_path / "etcd"))
    try:
        server.start()
    except EtcdBinaryNotFoundError as exc:
        if os.environ.get("ELASTIC_REQUIRE_ETCD"):
            raise
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()


def test_etcd_paused_past_the_lease_ttl_keeps_the_workers_and_their_state(
    tmp_path: Path, own_etcd: Any
) -> None:
    with cluster(tmp_path, own_etcd.endpoint, f"paused-{uuid.uuid4().hex[:8]}") as c:
        job = InPlaceJob(c, tmp_path, ("--nnodes", "1:2", "--inplace-ttl", str(TTL)), STEPS)
        job.open_gate(STEPS)
        agents = [job.start_node(STEP_TIME) for _ in range(2)]
        job.wait_for(lambda a: len(a.pids_by_gen().get(max(a.pids_by_gen(), default=-1),
                                                        ())) == 2
                     and max((int(d["step"]) for d in a.done), default=-1) >= 20,
                     "a world of 2 that trained 20 steps")
        before = job.audit()
        trained = {int(g["pid"]) for g in before.gens}
        loads = {int(g["pid"]): int(g["storage_loads"]) for g in before.gens}
        paused_at = time.time()
        own_etcd.pause()
        time.sleep(PAUSE_S)
        own_etcd.resume()
        codes = [a.wait(180) for a in agents]
        assert codes == [0, 0], c.logs()

        logs = "".join(a.output() for a in agents)
        assert "etcd dropped this node from the run (its lease expired)" in logs, (
            "no lease expired: the fault did not happen\n" + c.logs())
        audit = job.audit()
        assert {int(g["pid"]) for g in audit.gens} == trained, (
            "a worker process was restarted:\n" + c.logs())
        for g in audit.gens:
            assert int(g["storage_loads"]) == loads[int(g["pid"])], (
                f"worker {g['pid']} read a checkpoint after the pause: {g}")
        after = [d for d in audit.done if float(d["t"]) > paused_at + PAUSE_S]
        assert after, "nothing trained after the pause"
        check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                           seed=SEED)
        later = [c for c in commits(tmp_path / "ckpt")
                 if float(c["created_at"]) > paused_at + PAUSE_S]
        assert later and max(int(c["step"]) for c in later) >= STEPS - 10, (
            f"no checkpoint committed after the pause up to the end: {later}")
