"""A node that arrives after the job finished exits 0 and says so; a closed failed job does not.

A replacement started as the job ends (an autoscaler, a chaos campaign's replacement for a
node killed near the last step) finds torch's rendezvous closed. The finishing agents record
the job's success in etcd first, so the late node can tell "already finished" (exit 0) from a
rendezvous closed for any other reason (exit 3, one sentence).
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from elastic.etcd import EtcdClient, EtcdConfig
from elastic.membership import finished_key
from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

_TIMEOUT = 90.0


@pytest.mark.timeout(240)
def test_a_node_after_the_end_exits_zero_and_one_after_a_closed_failed_job_does_not(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    job = f"late-{uuid.uuid4().hex[:8]}"
    with cluster(tmp_path, etcd.endpoint, job) as c:
        first = c.start_elastic("--nnodes", "1:2",
                                worker_args=c.worker_args(steps=5, step_time=0.02))
        assert first.wait(_TIMEOUT) == 0, c.logs()

        late = c.start_elastic("--nnodes", "1:2", worker_args=c.worker_args(steps=5))
        assert late.wait(_TIMEOUT) == 0, c.logs()
        assert "already finished" in late.output(), late.output()[-3000:]

        # The same closed rendezvous without the record of success: a failure to report.
        client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,),
                                       request_timeout=timedelta(seconds=5)))
        try:
            assert client.delete(finished_key("/elastic", job)) == 1
        finally:
            client.close()
        refused = c.start_elastic("--nnodes", "1:2", worker_args=c.worker_args(steps=5))
        assert refused.wait(_TIMEOUT) == 3, c.logs()
        assert "elastic-run: error: the rendezvous failed (RendezvousClosedError" in \
            refused.output()
