"""An event log writer in a process of its own, as an agent would write it (S3 tests).

``ticks URL``: records a ``tick`` event (with its index) every 5 ms until killed.

``agent URL LOCAL NAME``: records one agent's scripted share of a 3-node job (node ``a`` also
records global rank 0's steps), in real time, to the URL and to the local directory at once,
then exits cleanly (flushing).
"""

from __future__ import annotations

import sys
import time

from elastic.eventlog import EventLog, FileSink

JOB = "s3-job"


def ticks(url: str) -> None:
    log = EventLog(url, job="ticks", source="agent")
    i = 0
    while True:
        log.record("tick", i=i)
        i += 1
        time.sleep(0.005)


def agent(url: str, local: str, name: str) -> None:
    log = EventLog(url, job=JOB, source="agent", node=f"{name}/1")
    log.add_sink(FileSink(local, job=JOB, source="agent"))
    world = 3
    log.record("agent_started", launched_at=time.time() - 0.5)
    log.record("round_started", round=0, group_rank="abc".index(name), world=world,
               reason="start")
    for step in range(40):
        time.sleep(0.01)
        if name == "a":
            log.record("step", round=0, step=step, duration_s=0.008, world=world)
            if step % 10 == 9:
                log.record("checkpoint", round=0, step=step + 1, blocked_s=0.001, final=False)
        if step == 25 and name == "c":
            log.close()  # node c leaves; its last records are put first
            return
        if step == 30 and name != "c":
            log.record("node_lost", round=0, ranks=[2])
            log.record("round_started", round=1, group_rank="abc".index(name), world=2,
                       reason="node_lost")
            world = 2
    for step in range(40, 60):
        time.sleep(0.01)
        if name == "a":
            log.record("step", round=1, step=step, duration_s=0.008, world=world)
    log.record("job_finished", round=1)
    log.record("agent_exited", round=1, outcome="succeeded", exit_code=0)
    log.close()


if __name__ == "__main__":
    if sys.argv[1] == "ticks":
        ticks(sys.argv[2])
    else:
        agent(sys.argv[2], sys.argv[3], sys.argv[4])
