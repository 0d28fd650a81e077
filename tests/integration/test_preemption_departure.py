"""A spot preemption notice makes one node of a 3-node job leave as planned; the others go on.

Real parts: an etcd server, three ``elastic-run`` agents with ``ElasticLoop`` workers
(checkpoints on local disk), and fake AWS IMDSv2 and GCP metadata servers on 127.0.0.1. Node 0
watches AWS, node 1 watches GCP, node 2 watches SIGTERM; one cloud announces the preemption.

Detection by timeout is made slow on purpose (member lease TTL and torch's heartbeat timeout
are both 60 s): the survivors' new round must start from the departing node's explicit leave,
which the test checks by ordering events of the job's event log (the new round's first step
comes before the departed node's lease could have expired), not by wall-clock thresholds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from elastic.eventlog import read_events
from tests.integration.launcher_scripts.harness import REPO, Cluster, cluster, etcd_or_skip
from tests.unit.launch.test_preemption_fakes import serve

pytestmark = [pytest.mark.etcd, pytest.mark.slow, pytest.mark.timeout(240)]

WORKER = Path(__file__).parent / "launcher_scripts" / "drain_worker.py"
# Long enough that AWS's 5 s poll hears the notice well before the job ends.
STEPS = 60
STEP_TIME_S = 0.25
TTL_S = 60  # member lease TTL and torch's heartbeat timeout (1 s x 60): slow on purpose
RDZV_CONF = (
    "join_timeout=90,last_call_timeout=1,close_timeout=10,heartbeat_timeout=5,"
    f"keep_alive_interval=1,keep_alive_max_attempt={TTL_S},member_ttl={TTL_S}"
)
WATCHING = {"aws": 0, "gcp": 1}  # which node hears which cloud; node 2 watches SIGTERM


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return out


def _steps(path: Path) -> list[dict[str, Any]]:
    return [r for r in _records(path) if "exit" not in r]


def _start(c: Cluster, node: int, watch: list[str], tmp: Path) -> None:
    c.start(
        ["--etcd", c.endpoint, "--job-id", c.job_id, "--nproc-per-node", "1",
         "--min-nodes", "2", "--max-nodes", "3", "--max-restarts", "0",
         "--rdzv-conf", RDZV_CONF, "--monitor-interval", "0.1",
         "--events-dir", str(tmp / "events"), "--preemption-drain-timeout", "30", *watch],
        [str(WORKER), "--out", str(c.out), "--checkpoint-dir", str(tmp / "ckpt"),
         "--steps", str(STEPS), "--interval", "10", "--step-time", str(STEP_TIME_S)],
    )


# One cloud end to end: the notice sources differ only in how a node process hears them,
# which test_preemption_notices.py checks for each (AWS, GCP, SIGTERM) in a real process.
@pytest.mark.parametrize("cloud", ["aws"])
def test_a_preempted_node_checkpoints_and_leaves_and_the_others_go_on_at_once(
    cloud: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    etcd = etcd_or_skip(request)
    with serve("aws") as (aws_url, aws), serve("gcp") as (gcp_url, gcp), cluster(
        tmp_path, etcd.endpoint, f"preempt-{cloud}-{uuid.uuid4().hex[:8]}"
    ) as c:
        _start(c, 0, ["--preemption-watch", "aws", "--aws-metadata-url", aws_url], tmp_path)
        _start(c, 1, ["--preemption-watch", "gcp", "--gcp-metadata-url", gcp_url], tmp_path)
        _start(c, 2, ["--preemption-watch", "sigterm"], tmp_path)
        out = Path(c.out)
        leaving = c.agents[WATCHING[cloud]]
        survivors = [a for a in c.agents if a is not leaving]

        c.wait_for(lambda _: sum(1 for r in _steps(out) if r["world"] == 3) >= 3 * 5, 120,
                   "five steps of the 3-node round")
        (aws if cloud == "aws" else gcp).preempt()

        assert leaving.wait(60) == 0, leaving.output()[-3000:]
        for agent in survivors:
            assert agent.wait(120) == 0, c.logs()

        # The departing node's worker stopped through the drain path, and the final
        # checkpoint it took part in was committed.
        leaving_pid = str(leaving.pid)
        exits = [r for r in _records(out) if "exit" in r and r["agent"] == leaving_pid]
        assert len(exits) == 1 and exits[0]["drained"] is True, exits
        drained_step = exits[0]["step"]
        commits = list((tmp_path / "ckpt").glob(f"step-{drained_step:010d}_r*/COMMIT.json"))
        assert commits, sorted(p.name for p in (tmp_path / "ckpt").iterdir())

        # Training went on to the end on the two survivors.
        steps = _steps(out)
        final_round = max(r["round"] for r in steps)
        last = [r for r in steps if r["round"] == final_round]
        assert {r["world"] for r in last} == {2}
        assert max(r["step"] for r in last) == STEPS - 1
        assert leaving_pid not in {r["agent"] for r in last}

        events = sorted(read_events(tmp_path / "events"), key=lambda e: e["time"])
        node = {a.pid: next(e["node"] for e in events if e["event"] == "agent_started"
                            and e["node"].endswith(f"/{a.pid}")) for a in c.agents}
        departure = [e for e in events if e["event"] == "planned_departure"]
        assert [(e["node"], e["notice"]) for e in departure] == [(node[leaving.pid], cloud)]
        assert departure[0]["announced"] is True and departure[0]["member_ttl"] == TTL_S
        left = [e for e in events if e["event"] == "left_rendezvous"]
        assert [(e["node"], e["drained"]) for e in left] == [(node[leaving.pid], True)]

        # The survivors started the next round because of the departure, and its first step
        # came before the departed node's lease (or torch's heartbeat) could have expired:
        # they did not wait for a failure timeout.
        new_rounds = [e for e in events if e["event"] == "round_started"
                      and e["round"] > departure[0]["round"]]
        assert {e["node"] for e in new_rounds} == {node[a.pid] for a in survivors}
        assert {e["reason"] for e in new_rounds} == {"planned_departure"}
        assert {e["world"] for e in new_rounds} == {2}
        # Had the node died silently when it left, its lease would have expired no earlier
        # than two thirds of a TTL later (keep-alives every TTL/3), torch's heartbeat timeout
        # later still; the new round formed before either.
        formed = max(e["time"] for e in new_rounds)
        assert departure[0]["time"] < formed < left[0]["time"] + TTL_S * 2 / 3
        first_new_step = min(e["time"] for e in events if e["event"] == "step"
                             and e["round"] > departure[0]["round"])
        assert formed < first_new_step < departure[0]["time"] + TTL_S

        # Nothing was charged as a failure, and no node was reported lost.
        assert not [e for e in events if e["event"] == "worker_failed" and e["cause"] != \
                    "planned_departure"]
        assert not [e for e in events if e["event"] == "node_lost"]
        outcomes = {e["node"]: e["outcome"] for e in events if e["event"] == "agent_exited"}
        assert outcomes == {node[leaving.pid]: "departed",
                            **{node[a.pid]: "succeeded" for a in survivors}}

        # The goodput report lists the departure as planned, and no failure.
        report = subprocess.run(
            [sys.executable, "-m", "launch", "goodput", str(tmp_path / "events"), "--json"],
            cwd=REPO, env=c.env, capture_output=True, text=True, timeout=60, check=True,
        )
        (job,) = json.loads(report.stdout)
        assert job["finished"] is True
        assert [(d["node"], d["planned"], d["cause"], d["drained"])
                for d in job["departures"]] == [(node[leaving.pid], True, cloud, True)]
        assert not [f for f in job["worker_failures"] if f["cause"] == "crash"]
        assert job["steps"] == STEPS and 0 < job["goodput"] < 1
        text = subprocess.run(
            [sys.executable, "-m", "launch", "goodput", str(tmp_path / "events")],
            cwd=REPO, env=c.env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout
        assert f"planned ({cloud} notice, workers drained)" in text
