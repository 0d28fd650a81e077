"""The short random campaign of CI: one job under 5 random faults from a printed seed.

The seed is fixed so that CI is reproducible; the long campaign (by command, see
``tests/chaos/campaign.py``) draws a fresh one. A failure prints the replay command.
"""

from __future__ import annotations

import pytest

from tests.chaos.campaign import plan, run_campaign
from tests.chaos.injector import KINDS, ChaosEnv, JobShape

pytestmark = [pytest.mark.chaos, pytest.mark.etcd, pytest.mark.slow]

CI_SEED = 20261123


def test_the_plan_depends_on_the_seed_alone() -> None:
    shape = JobShape()
    assert plan(7, 12, 5, 3, shape) == plan(7, 12, 5, 3, shape)
    assert plan(7, 12, 5, 3, shape) != plan(8, 12, 5, 3, shape)
    runs = plan(7, 12, 5, 3, shape)
    assert [len(r) for r in runs] == [5, 5, 2]
    assert all(f.kind in KINDS and 0 <= f.node < 3 for r in runs for f in r)


@pytest.mark.timeout(150)
def test_a_short_random_campaign_ends_correct(chaos: ChaosEnv) -> None:
    print(f"\nchaos campaign seed {CI_SEED}")
    tally = run_campaign(chaos, seed=CI_SEED, faults=5, per_run=5, nodes=2)
    assert tally["failed"] == [], tally
    assert tally["faults"] == 5, tally
