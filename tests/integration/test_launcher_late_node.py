"""A run's end: reusing a job id for a fresh run, late nodes, and a failed run's reason.

Running ``elastic-run`` again with the id of a job that ended starts a fresh run of the id at
once (a new generation): with default flags, a second in-place run right after the first
trains from step 0, and another job on the same etcd is not disturbed by any of it.

With ``--rdzv-conf linger=S`` (opt-in, for autoscaled deployments), a replacement that comes
within S seconds of the end exits instead: 0 ("already finished") after a finished run, the
run's reason in one sentence after a failed one.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from elastic.contract.records import EndRecord, GenerationRecord
from membership.etcd import EtcdClient, EtcdConfig
from membership.keys import JobKeys
from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip
from tests.integration.training.inplace_job import InPlaceJob

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

_TIMEOUT = 90.0
_STEPS = 6


def _generation(client: EtcdClient, job: str) -> GenerationRecord:
    kv = client.get(JobKeys("/elastic", job).generation_key)
    assert kv is not None
    return GenerationRecord.loads(kv.value, kv.key)


@pytest.mark.timeout(300)
def test_a_job_id_is_reused_at_once_for_a_fresh_run_beside_another_job(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    job = f"reuse-{uuid.uuid4().hex[:8]}"
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,),
                                   request_timeout=timedelta(seconds=5)))
    with cluster(tmp_path / "a", etcd.endpoint, job) as c, \
            cluster(tmp_path / "b", etcd.endpoint, f"other-{job}") as other:
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        # Another job on the same etcd runs through everything below, undisturbed.
        bystander = other.start_elastic("--nnodes", "1", worker_args=other.worker_args(
            steps=100, step_time=0.1))
        outcomes = []
        for run in ("first", "second"):  # the same command twice, each with its own storage
            training = InPlaceJob(c, tmp_path / "a" / run, ("--nnodes", "1"), steps=_STEPS,
                                  mode=None)
            training.open_gate(_STEPS)
            agent = training.start_node()
            assert agent.wait(_TIMEOUT) == 0, c.logs()
            assert "already finished" not in agent.output()
            outcomes.append(training.audit())
            assert _generation(client, job) == GenerationRecord(len(outcomes), "finished")
        for audit in outcomes:  # each run trained every step, from step 0, in place
            assert sorted(audit.final_attempts()) == list(range(_STEPS))
            assert min(int(d["step"]) for d in audit.done) == 0

        assert bystander.wait(_TIMEOUT) == 0, other.logs()
        steps = [s.step for s in other.steps()]
        assert sorted(steps) == list(range(1, 101)), "the other job was disturbed"
    client.close()


@pytest.mark.timeout(300)
def test_with_linger_late_nodes_exit_with_the_runs_outcome(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    job = f"late-{uuid.uuid4().hex[:8]}"
    linger = ("--rdzv-conf", "linger=60,last_call_timeout=1")
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,),
                                   request_timeout=timedelta(seconds=5)))
    with cluster(tmp_path, etcd.endpoint, job) as c:
        first = c.start_elastic("--nnodes", "1:2", *linger,
                                worker_args=c.worker_args(steps=5, step_time=0.02))
        assert first.wait(_TIMEOUT) == 0, c.logs()

        late = c.start_elastic("--nnodes", "1:2", *linger, worker_args=c.worker_args(steps=5))
        assert late.wait(_TIMEOUT) == 0, c.logs()
        assert "already finished" in late.output(), late.output()[-3000:]
        assert _generation(client, job) == GenerationRecord(1, "finished")

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
        assert len(c.steps()) == 5  # no late node trained
    client.close()
