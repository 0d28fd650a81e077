"""No pickle in etcd: a crafted pickle in every key of a running job's prefix runs nothing.

Two real ``elastic-run`` agents train; a pickle whose unpickling would create a marker file is
written, key by key, into every key of the job (the generation, both node records, the world,
the leader, and keys the run does not have yet: its end, its torchrun store, a foreign node
record, a key whose name is not UTF-8). Each agent refuses the value with one sentence or
ignores it, takes back the keys the protocol needs, and the job trains to its last step; an
agent started while the generation key holds the pickle refuses to start, in one sentence.
No marker file, no traceback in any log.
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from membership.etcd import EtcdClient, EtcdConfig
from membership.keys import JobKeys
from tests.integration.launcher_scripts.harness import cluster, etcd_or_skip

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

_TIMEOUT = 120.0


class Payload:
    """Unpickling this creates ``path``: proof that someone ran the pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:
        return os.open, (str(self.path), os.O_CREAT | os.O_WRONLY)


@pytest.mark.timeout(300)
def test_a_pickle_in_every_key_of_a_running_job_runs_nothing(
    request: pytest.FixtureRequest, tmp_path: Path,
) -> None:
    etcd: Any = etcd_or_skip(request)
    job = f"pickle-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "the-pickle-ran"
    pickled = pickle.dumps(Payload(marker))
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,),
                                   request_timeout=timedelta(seconds=5)))
    keys = JobKeys("/elastic", job)
    run = keys.for_generation(1)
    # The job trains until told to stop: it must still run when the late agent reads the
    # generation key (a job that ended meanwhile has replaced it with a valid record).
    stop = tmp_path / "stop"
    with cluster(tmp_path, etcd.endpoint, job) as c:
        agents = [c.start_elastic("--nnodes", "2", worker_args=c.worker_args(
            "--stop-file", str(stop), steps=100_000, step_time=0.1)) for _ in range(2)]
        c.wait_for(lambda steps: any(s.step >= 3 for s in steps), _TIMEOUT, "training")

        existing = [kv.key for kv in client.get_prefix(keys.job_root)]
        assert keys.generation_key in existing and run.world in existing
        assert run.leader in existing and len([k for k in existing if "/nodes/" in k]) == 2
        targets = [k for k in existing if k != keys.generation_key] + [
            run.end, run.store + "e1/MASTER_ADDR", run.node("intruder")]
        for key in targets:
            client.put(key, pickled)
            time.sleep(0.5)
        # A key name that is not UTF-8 under the node records the leader watches.
        client.call("/v3/kv/put", {"key": _b64(run.nodes.encode() + b"\xff\xfe"),
                                   "value": _b64(pickled)})

        client.put(keys.generation_key, pickled)
        refused = c.start_elastic("--nnodes", "2", worker_args=c.worker_args(steps=10))
        assert refused.wait(_TIMEOUT) != 0
        last = refused.output().rstrip().splitlines()[-1]
        assert last.startswith(f"elastic-run: error: etcd key {keys.generation_key} holds a "
                               "value that is not JSON"), last
        assert last.endswith("only elastic-run may write the job's keys: delete it or use "
                             "another --job-id."), last

        # The job trained on through every pickle, and ends cleanly.
        trained = max(s.step for s in c.steps())
        c.wait_for(lambda steps: max(s.step for s in steps) >= trained + 5, _TIMEOUT,
                   "training past the pickles")
        stop.touch()
        for agent in agents:
            assert agent.wait(_TIMEOUT) == 0, c.logs()
        logs = "\n".join(a.output() for a in c.agents)
    client.close()
    assert not marker.exists(), "a pickle from etcd was unpickled"
    assert "Traceback" not in logs, logs[-6000:]
    assert "holds a value that is not JSON" in logs  # refused in one sentence, not silently


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()
