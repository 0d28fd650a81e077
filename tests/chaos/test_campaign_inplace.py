"""The short in-place campaign of CI: one job on a cluster of network namespaces under the
four new faults of a printed seed (a silent host, a live hang, a SIGSTOP, a host that comes
back), checked like every campaign run (weights, audit, last checkpoint, processes, cluster).

The seed is fixed so that CI is reproducible, and long cuts are left out to keep it short;
the release campaign (``python -m tests.chaos.campaign --mode inplace``, see
``docs/chaos-inplace.md``) draws fresh seeds, every fault kind and long cuts. A
failure prints the replay command.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.campaign import plan_inplace, run_inplace_campaign
from tests.chaos.netns_chaos import KINDS, NetnsShape
from tests.support.netns_pytest import require_netns

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.slow, pytest.mark.netns]

CI_SEED = 20270594


def test_the_inplace_plan_depends_on_the_seed_alone() -> None:
    shape = NetnsShape()
    assert plan_inplace(7, 12, 5, 3, shape) == plan_inplace(7, 12, 5, 3, shape)
    assert plan_inplace(7, 12, 5, 3, shape) != plan_inplace(8, 12, 5, 3, shape)
    runs = plan_inplace(7, 12, 5, 3, shape)
    assert [len(r) for r in runs] == [5, 5, 2]
    assert all(f.kind in KINDS and 0 <= f.node < 3 for r in runs for f in r)
    # Each node's crashes stay within the default --max-restarts (3) in any plan.
    for run in plan_inplace(11, 400, 15, 3, NetnsShape(steps=200)):
        for node in range(3):
            kills = 0
            for fault in run:
                if fault.node == node and fault.kind in ("kill_node", "silent_host"):
                    kills = 0
                kills += fault.node == node and fault.kind == "kill_worker"
                assert kills <= 3, run


def test_the_ci_seed_draws_the_new_faults() -> None:
    (run,) = plan_inplace(CI_SEED, 4, 4, 3, NetnsShape(), long_cuts=False)
    assert {f.kind for f in run} == {"silent_host", "hang_worker", "sigstop_worker",
                                     "host_returns"}


@pytest.mark.timeout(420)
def test_a_short_inplace_campaign_on_namespaces_ends_correct(tmp_path: Path) -> None:
    require_netns()
    print(f"\nin-place chaos campaign seed {CI_SEED}")
    tally = run_inplace_campaign(tmp_path, seed=CI_SEED, faults=4, per_run=4, nodes=3,
                                 long_cuts=False)
    assert tally["failed"] == [], tally
    assert tally["faults"] == 4 and tally["hangs"] == 0, tally
