"""Acceptance 1: ``elastic-run --standalone`` trains on one machine with an embedded etcd."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.integration.launcher_scripts.harness import REPO, cluster

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

EXAMPLE = REPO / "examples" / "train.py"


def test_standalone_runs_two_workers_to_completion(tmp_path: Path) -> None:
    with cluster(tmp_path, "", f"standalone-{uuid.uuid4().hex[:8]}") as c:
        agent = c.start(["--standalone", "--nproc-per-node", "2"], c.worker_args(steps=10))
        assert agent.wait(120) == 0, c.logs()
        finals = sorted((s.rank, s.world) for s in c.steps() if s.step == 10)
        assert finals == [(0, 2), (1, 2)]
        assert "Standalone etcd at 127.0.0.1:" in agent.output()


def test_demo_command_trains_the_example_to_completion(tmp_path: Path) -> None:
    # The README's command, run from a directory of its own: the example checkpoints to
    # runs/<job id> under the working directory, as a fresh clone's would (a standalone job
    # gets a fresh id, so a later job in the same directory does not resume the demo).
    home = tmp_path / "clone"
    home.mkdir()
    with cluster(tmp_path, "", "demo") as c:
        agent = c.start(["--standalone", "--nproc-per-node", "2"], [str(EXAMPLE)], cwd=home)
        code = agent.wait(240)
        assert code == 0, c.logs()
        # Trained to its last step and committed a checkpoint where the README says.
        assert "step 200/200" in agent.output(), c.logs()
        assert list((home / "runs").glob("standalone-*/*/COMMIT.json")), c.logs()
