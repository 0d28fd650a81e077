"""A rank 0 whose final checkpoint was fenced off: the job finishes the steps again, no hang.

Found by the in-place chaos campaign (seed 4242, run 2): an etcd member was killed near the
end, both nodes' leases were not fresh when the last step completed, so the commit fence
refused the final checkpoint. Rank 0 then rightly refused to end the job without it (it exits
as a failure of the partition), while rank 1 finished and exited 0. Its slot still showed
ready in its node record, so the leader kept writing worlds that named it: worlds nobody
could build, one every build timeout, forever.

Now a finished worker is neither ready nor lost (:mod:`membership.decide`): the steps after
the last committed checkpoint are trained again by the workers that can still train (here
rank 0's new incarnation, alone), which commit the final checkpoint and end the job.

Two ``elastic-run`` agents in place (``--nnodes 1:2``, TTL 3 s) on an etcd of their own. The
last step is held; etcd is SIGSTOPped until both leases are stale (not refreshed for half the
TTL: no commit may happen), then the last step is released. Checks: rank 0 refused to end
the job and rank 1 exited 0 (the fault happened); both agents exit 0; the final checkpoint
is committed at the last step; every step trained exactly its global batch, once; the final
weights equal an undisturbed run's.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launcher_scripts.harness import cluster, wait_until
from tests.integration.training.inplace_audit import check_exactly_once
from tests.integration.training.inplace_job import DATASET, GLOBAL_BATCH, SEED, InPlaceJob
from tests.support.netns_job import MICRO_BATCH, commits, undisturbed_run

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 20
STEP_TIME = 0.05
TTL = 3
#: ``Lease.fresh``: refreshed less than half the TTL ago; a second more for the agents to
#: tell their workers (every ``--monitor-interval``).
STALE_AFTER_S = TTL / 2 + 1.0


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


def test_a_final_checkpoint_fenced_off_is_trained_again_and_the_job_ends(
    tmp_path: Path, own_etcd: Any
) -> None:
    reference = undisturbed_run(tmp_path / "reference", steps=STEPS)
    root = tmp_path / "job"
    root.mkdir()
    with cluster(root, own_etcd.endpoint, f"fenced-{uuid.uuid4().hex[:8]}") as c:
        job = InPlaceJob(c, root, ("--nnodes", "1:2", "--inplace-ttl", str(TTL)), STEPS,
                         worker_args=("--micro-batch", str(MICRO_BATCH)))
        job.open_gate(STEPS - 1)  # every step but the last
        agents = [job.start_node(STEP_TIME) for _ in range(2)]
        job.wait_for(lambda a: sum(1 for d in a.done if int(d["step"]) == STEPS - 2
                                   and int(d["world"]) == 2) == 2,
                     f"both ranks of a world of 2 at step {STEPS - 2}", timeout=120)
        own_etcd.pause()
        try:
            time.sleep(STALE_AFTER_S)
            job.open_gate(STEPS)
            logs = lambda: "".join(a.output() for a in agents)  # noqa: E731
            wait_until(lambda: "not ending the job" in logs() and "exited 0" in logs(), 60,
                       "rank 0 to refuse to end the job and rank 1 to exit 0")
        finally:
            own_etcd.resume()
        codes = [a.wait(180) for a in agents]
        assert codes == [0, 0], c.logs()
        final = max(commits(root / "ckpt"), key=lambda record: int(record["step"]))
        assert int(final["step"]) == STEPS, f"the final checkpoint: {final}\n{c.logs()}"
        audit = job.audit()
        assert STEPS - 1 in audit.redone_steps(), (
            f"the last step was not trained again\n{c.logs()}")
    check_exactly_once(audit, steps=STEPS, global_batch=GLOBAL_BATCH, dataset=DATASET,
                       seed=SEED)
    got = torch.load(job.weights, weights_only=True)
    want = torch.load(reference, weights_only=True)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-9, f"final weights differ from the undisturbed run's by {worst}"
