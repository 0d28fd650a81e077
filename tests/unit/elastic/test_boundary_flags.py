"""BoundaryFlags: every rank gets the same agreed flags, one step late (real gloo groups)."""

from __future__ import annotations

import json
import multiprocessing as mp
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.boundary_flags import AgreementCadence, BoundaryFlags


def _rank(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    flags = BoundaryFlags(2, torch.device("cpu"))
    seen = []
    for step in range(6):
        # Rank 0 asks to drain at step 2; rank 1 sees a membership change at step 4.
        agreed = flags.exchange([rank == 0 and step == 2, rank == 1 and step == 4],
                                measure=float(10 * step + rank))
        seen.append(None if agreed is None else [*agreed, flags.agreed_measure])
    seen.append(list(flags.flush() or ()))
    flags.exchange([True, True])
    flags.reset()  # a new world: the exchange in flight is dropped
    seen.append(flags.exchange([False, False]))
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_gets_the_same_flags_one_step_late(tmp_path: Path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, server.port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        if p.is_alive():
            p.kill()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] == seen[1]
    f, t = False, True
    # Each exchange also agrees on the largest measure any rank sent (rank 1's, one late).
    assert seen[0] == [None, [f, f, 1.0], [f, f, 11.0], [t, f, 21.0], [f, f, 31.0],
                       [f, t, 41.0], [f, f], None]


def test_a_world_of_one_gets_its_flags_back_at_once() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        flags = BoundaryFlags(2, torch.device("cpu"))
        assert flags.exchange([True, False]) == (True, False)
        assert flags.flush() is None
        with pytest.raises(ValueError, match=r"expected 2 flags, got 1"):
            flags.exchange([True])
    finally:
        dist.destroy_process_group()


def test_the_cadence_spaces_agreements_by_the_agreed_step_time() -> None:
    cadence = AgreementCadence(interval_s=0.05, max_steps_between=64)
    assert cadence.due(0)  # at once after a reset, before any step time is known
    cadence.agreed(0, 0.0)
    assert cadence.due(1)
    cadence.agreed(1, 0.01)  # 10 ms steps: every 5 steps (50 ms)
    assert [s for s in range(2, 12) if cadence.due(s)] == [6, 7, 8, 9, 10, 11]
    cadence.agreed(6, 0.2)  # steps longer than the interval: every step
    assert cadence.due(7)
    cadence.agreed(7, 1e-6)  # tiny steps: capped
    assert not cadence.due(70) and cadence.due(71)
    cadence.reset()  # a new world: the next boundary agrees, on every rank alike
    assert cadence.due(8)
    assert cadence.step_time(8) == 0.0  # nothing measured since the reset
