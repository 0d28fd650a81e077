"""A run's end: late nodes, a failed run's reason, and reusing a job id for a fresh run.

A replacement started as the job ends (an autoscaler, a chaos campaign's replacement for a
node killed near the last step) finds the run's end record, which lingers on a lease
(``--rdzv-conf linger``): after a finished run it exits 0 ("already finished"); after a failed
run it fails with the run's reason, in one sentence. Once the end record has expired, the same
job id starts a fresh run (a new generation): it trains from step 0, and a second job on the
same etcd is not disturbed by any of this.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd import EtcdClient, EtcdConfig
from elastic.rdzv.keys import JobKeys
from elastic.rdzv.records import EndRecord
from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

_TIMEOUT = 90.0
_LINGER = 4


@pytest.mark.timeout(300)
def test_late_nodes_a_failed_runs_reason_and_a_reused_job_id(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    job = f"late-{uuid.uuid4().hex[:8]}"
    linger = ("--rdzv-conf", f"linger={_LINGER},last_call_timeout=1")
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,),
                                   request_timeout=timedelta(seconds=5)))
    with cluster(tmp_path / "a", etcd.endpoint, job) as c, \
            cluster(tmp_path / "b", etcd.endpoint, f"other-{job}") as other:
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        # Another job on the same etcd runs through everything below, undisturbed.
        bystander = other.start_elastic("--nnodes", "1", *linger,
                                        worker_args=other.worker_args(steps=60,
                                                                      step_time=0.2))
        first = c.start_elastic("--nnodes", "1:2", *linger,
                                worker_args=c.worker_args(steps=5, step_time=0.02))
        assert first.wait(_TIMEOUT) == 0, c.logs()

        late = c.start_elastic("--nnodes", "1:2", *linger, worker_args=c.worker_args(steps=5))
        assert late.wait(_TIMEOUT) == 0, c.logs()
        assert "already finished" in late.output(), late.output()[-3000:]

        # The same run, ended as a failure instead: a late node reports the run's reason.
        keys = JobKeys("/elastic", job, 1)
        client.put(keys.end, EndRecord("failed", "the training script failed on every "
                                       "worker at step 3: ValueError: boom", 3).dumps())
        refused = c.start_elastic("--nnodes", "1:2", *linger,
                                  worker_args=c.worker_args(steps=5))
        assert refused.wait(_TIMEOUT) == 1, c.logs()
        assert refused.output().rstrip().splitlines()[-1] == (
            f"elastic-run: error: job {job} failed: the training script failed on every "
            "worker at step 3: ValueError: boom")

        # Once the end record is gone, the job id is reused for a fresh run from step 0.
        client.delete(keys.end)
        time.sleep(1)
        c.ckpt.unlink()  # a fresh run: the plain worker's own step file starts over
        before = len(c.steps())
        fresh = c.start_elastic("--nnodes", "1:2", *linger,
                                worker_args=c.worker_args(steps=4, step_time=0.02))
        assert fresh.wait(_TIMEOUT) == 0, c.logs()
        new_steps = [s.step for s in c.steps()[before:]]
        assert new_steps[:1] == [1] and max(new_steps) == 4, new_steps
        generation = client.get("/elastic/" + job + "/generation")
        assert generation is not None and b'"generation":2' in generation.value

        assert bystander.wait(_TIMEOUT) == 0, other.logs()
        steps = [s.step for s in other.steps()]
        assert sorted(steps) == list(range(1, 61)), "the other job was disturbed"
    client.close()
