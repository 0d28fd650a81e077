"""Acceptance 3 of the event log on object storage: moto's S3 server on 127.0.0.1.

* a writer process SIGKILLed mid-run loses at most the events of its last flush interval and
  one put;
* a real ``elastic-run`` agent of a 3-node job SIGKILLed mid-run (the one writing the steps)
  loses at most its last second: every record its ``--events-copy`` (a local file appended as
  it records) holds from before that second is in S3;
* three writer processes (agents) putting chunks of one job at once lose nothing: the goodput
  report read from ``s3://`` equals the one read from the local files they wrote alongside;
* a real 3-node ``elastic-run`` job with ``--events-dir s3://...`` and a worker kill: every
  step is in the log exactly once, every agent's start and exit too, and ``elastic-run goodput
  s3://...`` (the command) prints the same report as for a local copy of the objects.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs

from elastic.event_chunks import DEFAULT_FLUSH_INTERVAL_S
from elastic.eventlog import read_events
from launch import goodput
from tests.integration.launcher_scripts.harness import (
    REPO,
    cluster,
    etcd_or_skip,
    kill,
    wait_until,
)
from tests.integration.training.inplace_job import EVENT_TIMEOUT, STEPS, InPlaceJob
from tests.support.moto_s3 import moto_s3, s3_options

pytestmark = [pytest.mark.s3]

WRITER = Path(__file__).with_name("launcher_scripts") / "events_writer.py"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


_options = s3_options


@pytest.fixture
def bucket(endpoint: str) -> str:
    name = f"events-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**_options(endpoint)).mkdir(name)
    return name


def _child_env(endpoint: str) -> dict[str, str]:
    # How an agent gets its S3 settings: fsspec reads FSSPEC_S3_* from the environment.
    env = dict(os.environ, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x",
               AWS_DEFAULT_REGION="us-east-1", FSSPEC_S3_ENDPOINT_URL=endpoint)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.mark.timeout(60)
def test_a_writer_sigkilled_mid_run_loses_at_most_its_last_flush_interval_and_put(
    endpoint: str, bucket: str,
) -> None:
    url = f"s3://{bucket}/events"
    fs = s3fs.S3FileSystem(**_options(endpoint))
    proc = subprocess.Popen([sys.executable, str(WRITER), "ticks", url],
                            env=_child_env(endpoint), cwd=REPO)

    def objects() -> int:
        fs.invalidate_cache()
        return len(fs.find(url))

    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(read_events(url, _options(endpoint)))) \
                < 300:
            time.sleep(0.2)
        # The writer puts a chunk every flush interval: once the next one lands, kill it at
        # a random point of the interval that follows.
        before = objects()
        while objects() == before:
            assert time.monotonic() < deadline + 30, "the writer put no further chunk"
            time.sleep(0.02)
        time.sleep(random.uniform(0.0, DEFAULT_FLUSH_INTERVAL_S))
        killed_at = time.time()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    ticks = sorted((e["i"], e["time"]) for e in read_events(url, _options(endpoint)))
    assert len(ticks) >= 300
    assert [i for i, _ in ticks] == list(range(len(ticks))), "a record in the middle is missing"
    last = ticks[-1][1]
    # The design: a SIGKILL loses the records not yet put, at most the last flush interval
    # (0.5 s) plus one put (about 10 ms to moto on loopback; a second covers a loaded machine).
    assert killed_at - last <= DEFAULT_FLUSH_INTERVAL_S + 1.0, \
        f"lost {killed_at - last:.2f} s of events"


@pytest.mark.timeout(90)
def test_three_writers_on_s3_give_the_same_report_as_their_local_files(
    endpoint: str, bucket: str, tmp_path: Path,
) -> None:
    url = f"s3://{bucket}/events"
    local = tmp_path / "events"
    procs = [subprocess.Popen([sys.executable, str(WRITER), "agent", url, str(local), name],
                              env=_child_env(endpoint), cwd=REPO) for name in "abc"]
    for proc in procs:
        assert proc.wait(60) == 0
    from_s3 = goodput.load(url, _options(endpoint))
    from_files = goodput.load(str(local))
    assert set(from_s3) == set(from_files) == {"s3-job"}
    assert len(from_s3["s3-job"]) == len(from_files["s3-job"])
    report_s3 = goodput.build_report("s3-job", from_s3["s3-job"]).to_json()
    report_files = goodput.build_report("s3-job", from_files["s3-job"]).to_json()
    assert report_s3 == report_files
    assert report_s3["steps"] == 60 and len(report_s3["changes"]) == 1
    # Three writers, each under a directory of its own.
    objects = s3fs.S3FileSystem(**_options(endpoint)).find(f"{bucket}/events")
    assert len({p.split("/")[-2] for p in objects}) == 3


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_real_three_node_job_logs_every_step_once_to_s3(
    request: pytest.FixtureRequest, endpoint: str, bucket: str, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    url = f"s3://{bucket}/job/events"
    with cluster(tmp_path, etcd.endpoint, f"s3-{uuid.uuid4().hex[:8]}") as c:
        c.env.update(_child_env(endpoint))
        job = InPlaceJob(c, tmp_path, ("--nnodes", "1:3", "--max-restarts", "3",
                                       "--inplace-ttl", "5", "--events-dir", url), mode=None)
        job.open_gate(0)
        agents = [job.start_node(0.05) for _ in range(3)]
        job.wait_for(lambda a: len(job.current_world(a)[1]) == 3, "a world of 3")
        job.open_gate(10)
        job.wait_for(lambda a: any(d["step"] >= 9 for d in a.done), "step 9")
        # Held at the gate before step 10. A worker coalesces its step records for up to
        # 1.5 x COALESCE_S before sending them (elastic.telemetry), and a SIGKILL loses what it
        # holds: that bound is the SIGKILL test's below; this one checks that every record
        # sent reaches the log exactly once across the kill, so it kills once they are in it.
        wait_until(lambda: {e["step"] for e in read_events(url, _options(endpoint))
                            if e["event"] == "step"} >= set(range(10)), EVENT_TIMEOUT,
                   "steps 0-9 in the event log")
        kill([job.worker_pid(agents[1])], signal.SIGKILL)
        job.open_gate(STEPS)
        for agent in agents:
            assert agent.wait(EVENT_TIMEOUT) == 0, c.logs()
        job_id = c.job_id
    events = list(read_events(url, _options(endpoint)))
    steps = sorted(e["step"] for e in events if e["event"] == "step")
    assert steps == sorted(int(s) for s in job.audit().final_attempts()) + [
        s for s in job.audit().redone_steps()], "the log must hold each step execution once"
    assert sorted(e["event"] for e in events if e["event"].startswith("agent_")) == \
        ["agent_exited"] * 3 + ["agent_started"] * 3
    mirror = tmp_path / "mirror"
    s3fs.S3FileSystem(**_options(endpoint)).get(f"{bucket}/job/events", str(mirror),
                                               recursive=True)
    cli = [sys.executable, "-m", "launch", "goodput", "--json", "--job", job_id]
    remote = subprocess.run([*cli, url, "--storage-option",
                             f"client_kwargs.endpoint_url={endpoint}"],
                            env=_child_env(endpoint), cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert remote.returncode == 0, remote.stderr
    copy = subprocess.run([*cli, str(mirror)], env=_child_env(endpoint), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert copy.returncode == 0, copy.stderr
    assert json.loads(remote.stdout) == json.loads(copy.stdout)
    (report,) = json.loads(remote.stdout)
    assert report["finished"] and report["steps"] == STEPS


def _lines(records: list[dict[str, Any]]) -> set[str]:
    return {json.dumps(r, sort_keys=True) for r in records}


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_real_agent_sigkilled_mid_run_loses_at_most_its_last_second(
    request: pytest.FixtureRequest, endpoint: str, bucket: str, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    url = f"s3://{bucket}/job/events"
    copies = tmp_path / "copies"
    steps = 400  # 0.05 s each: the job trains for the whole test

    def copy_of(pid: int) -> list[dict[str, Any]]:
        return [e for e in read_events(copies) if e["node"] == f"{socket.gethostname()}/{pid}"]

    with cluster(tmp_path, etcd.endpoint, f"s3kill-{uuid.uuid4().hex[:8]}") as c:
        c.env.update(_child_env(endpoint))
        job = InPlaceJob(c, tmp_path, ("--nnodes", "1:3", "--max-restarts", "3",
                                       "--inplace-ttl", "5", "--events-dir", url,
                                       "--events-copy", str(copies)), mode=None, steps=steps)
        job.open_gate(0)
        agents = [job.start_node(0.05) for _ in range(3)]
        job.wait_for(lambda a: len(job.current_world(a)[1]) == 3, "a world of 3")
        job.open_gate(steps)
        # The agent of global rank 0 logs every step: the busiest writer, the one to kill.
        writer = job.wait_for(
            lambda a: next((agent for agent in agents
                            if sum(e["event"] == "step" for e in copy_of(agent.pid)) >= 60),
                           None),
            "an agent to log 60 steps (3 s of training)")
        killed_at = time.time()
        kill([writer.pid], signal.SIGKILL)
        assert writer.proc.wait(10) == -signal.SIGKILL
        # Its records: the local copy it appended as it recorded them, and what reached S3.
        copied = copy_of(writer.pid)
    in_s3 = [e for e in read_events(url, _options(endpoint))
             if e["node"] == f"{socket.gethostname()}/{writer.pid}"]
    due = [r for r in copied if r["time"] <= killed_at - 1.0]
    assert sum(r["event"] == "step" for r in due) >= 30, "too few records to test anything"
    missing = _lines(due) - _lines(in_s3)
    assert not missing, (f"{len(missing)} of the {len(due)} records logged more than 1 s "
                         f"before the kill are not in S3; the newest: "
                         f"{max(missing, key=lambda line: json.loads(line)['time'])}")
    assert _lines(in_s3) <= _lines(copied), "S3 holds records the agent never logged"
    newest = max(r["time"] for r in in_s3)
    lost = sorted(r["time"] for r in copied if json.dumps(r, sort_keys=True)
                  not in _lines(in_s3))
    print(f"killed {killed_at - newest:.2f} s after its newest record in S3; "
          f"{len(lost)} of {len(copied)} records lost, the oldest "
          f"{killed_at - lost[0] if lost else 0:.2f} s before the kill")
