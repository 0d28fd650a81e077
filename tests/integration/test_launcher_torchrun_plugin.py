"""Acceptance 3: plain torchrun runs a two-node job through our etcd-v3 entry point."""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import FAST_RDZV_CONF, cluster, etcd_or_skip

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Any:
    return etcd_or_skip(request)


# The agents' wait ends before pytest's timeout, so that a hang fails with their logs.
@pytest.mark.timeout(240)
def test_torchrun_runs_a_two_node_job_on_the_etcd_v3_backend(
    tmp_path: Path, etcd: Any
) -> None:
    job = f"torchrun-{uuid.uuid4().hex[:10]}"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    flags = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd.endpoint,
             "--rdzv-id", job, "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-conf", FAST_RDZV_CONF]
    with cluster(tmp_path, etcd.endpoint, job) as c:
        agents = [c.start(flags, c.worker_args(steps=10), launcher=torchrun) for _ in range(2)]
        codes = [a.wait(90) for a in agents]
        assert codes == [0, 0], c.logs()
        finals = [s for s in c.steps() if s.step == 10]
        assert sorted((s.rank, s.world) for s in finals) == [(0, 2), (1, 2)]
        assert "etcd-v3" in agents[0].output()
        # The rendezvous' own INFO lines go out through torchrun's logging, at its LOGLEVEL.
        assert all(re.search(r"rendezvous epoch \d+: node [01] of 2", a.output())
                   for a in agents), c.logs()
