"""Lightning under ``elastic-run``: a 3-node job through a worker SIGKILL, a preemption notice
and a node's SIGKILL ends with the undisturbed run's weights (see ``scenario.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.frameworks.scenario import Scenario, check, worst_difference
from tests.integration.launcher_scripts.harness import etcd_or_skip
from tests.support.frameworks import framework

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(900)]

JOB = Path(__file__).with_name("lightning_job.py")


def test_lightning_job_survives_a_worker_kill_a_preemption_and_a_node_kill(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    framework("lightning")
    etcd = etcd_or_skip(request)
    # Two micro-batches per step on every world: 4-3-3 shares split 2+2, 2+1, 2+1.
    outcome = Scenario(JOB, tmp_path, etcd.endpoint, ["--accumulate", "2"]).run()
    check(outcome)
    print(f"\nLightning scenario: {outcome.wall_s:.0f} s, worlds "
          f"{[(r.world, r.resumed) for r in outcome.rounds.values()]}, drained at "
          f"{outcome.drained_at}, weights within {worst_difference(outcome):.1e}")
