"""A drain asked of one rank stops every rank at the same step (real gloo groups)."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic.integrations._drain import DrainAgreement

WORLD = 2


def _rank(rank: int, port: int, out: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    drain = DrainAgreement(torch.device("cpu"))
    stopped = None
    for step in range(1, 200):
        time.sleep(0.004 * (rank + 1))  # ranks of different speeds
        if rank == 1 and step == 20:
            drain.request()  # what SIGTERM does on the preempted node only
        tensor = torch.ones(4)
        dist.all_reduce(tensor)  # the step's own collective (DDP's, in a framework)
        if drain.at_step_end(step):
            stopped = step
            break
    drain.settle()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"stopped": stopped}))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_drain_asked_of_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, server.port, str(tmp_path)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        if p.is_alive():
            p.kill()
    stops = [json.loads((tmp_path / f"rank{r}.json").read_text())["stopped"]
             for r in range(WORLD)]
    # The same step everywhere, soon after the request (a few agreements, one every ~50 ms).
    assert len(set(stops)) == 1 and stops[0] is not None, stops
    assert 20 <= stops[0] <= 60, stops
