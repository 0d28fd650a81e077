"""Acceptance 5 end to end: bad input gets one sentence, a non-zero exit, and no hang."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launcher_scripts.harness import REPO, WORKER, etcd_or_skip


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Any:
    return etcd_or_skip(request)


def _elastic_run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("ELASTIC_ETCD_ENDPOINTS", None)
    return subprocess.run([sys.executable, "-m", "launch", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("elastic-run: error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0].removeprefix("elastic-run: error: ")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_min_nodes_above_max_nodes_is_rejected() -> None:
    proc = _elastic_run("--min-nodes", "3", "--max-nodes", "2", "--etcd", "127.0.0.1:2379",
                        str(WORKER))
    assert proc.returncode == 2
    assert re.fullmatch(r"--min-nodes \(3\) must not exceed --max-nodes \(2\); .*\.",
                        _error_line(proc))


def test_unparsable_endpoint_is_rejected() -> None:
    proc = _elastic_run("--etcd", "http//nohost", str(WORKER))
    assert proc.returncode == 2
    assert "http//nohost" in _error_line(proc)


def test_missing_script_is_rejected(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_train.py"
    proc = _elastic_run("--etcd", "127.0.0.1:2379", str(missing))
    assert proc.returncode == 2
    assert _error_line(proc) == (
        f"training script ({missing}) does not exist; check the path."
    )


def test_unreachable_etcd_fails_within_the_deadline_naming_the_endpoints() -> None:
    endpoint = f"127.0.0.1:{_closed_port()}"
    proc = _elastic_run("--etcd", endpoint, "--etcd-connect-timeout", "2", "--job-id", "x",
                        str(WORKER), "--out", "/dev/null", "--ckpt", "/dev/null", timeout=60)
    assert proc.returncode == 3
    message = _error_line(proc)
    assert endpoint in message
    assert message.startswith("no etcd answered at")


@pytest.mark.etcd
def test_corrupt_rendezvous_state_is_a_one_sentence_error(etcd: Any) -> None:
    from membership.etcd import EtcdClient, EtcdConfig

    job = f"corrupt-{uuid.uuid4().hex[:8]}"
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)))
    client.put(f"/elastic/{job}/generation", b"\x80\x04garbage, not a generation record")
    proc = _elastic_run("--etcd", etcd.endpoint, "--job-id", job,
                        "--rdzv-conf", "join_timeout=20", str(WORKER), "--out", "/dev/null",
                        "--ckpt", "/dev/null", timeout=90)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert _error_line(proc) == (
        f"etcd key /elastic/{job}/generation holds a value that is not JSON (it starts with "
        "b'\\x80\\x04garbage, n'); only elastic-run may write the job's keys: delete it or "
        "use another --job-id."
    )


@pytest.mark.etcd
def test_nproc_per_node_0_is_refused_in_one_sentence_before_anything_starts(
    etcd: Any, tmp_path: Path
) -> None:
    """Issue 13, acceptance 3: no etcd key written, no worker started, one line of output."""
    from membership.etcd import EtcdClient, EtcdConfig

    job = f"nproc0-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "steps.csv"
    proc = _elastic_run("--etcd", etcd.endpoint, "--job-id", job, "--nproc-per-node", "0",
                        str(WORKER), "--out", str(out), "--ckpt", str(tmp_path / "ckpt"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "elastic-run: error: --nproc-per-node (0) must be a positive number of workers per node "
        "(or auto, cpu, gpu); pass for example --nproc-per-node 1."]
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)))
    try:
        assert client.get_prefix(f"/elastic/{job}") == []
    finally:
        client.close()
    assert not out.exists()


@pytest.mark.parametrize("command", [(), ("status",)], ids=["run", "status"])
def test_a_job_id_the_rendezvous_would_refuse_is_refused_in_one_sentence(
    etcd: Any, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """Issue 25: ``--job-id a/b`` ran with its keys under /elastic/a/b/, inside job a's."""
    from membership.etcd import EtcdClient, EtcdConfig

    parent = f"parent-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "steps.csv"
    script = () if command else (str(WORKER), "--out", str(out), "--ckpt",
                                 str(tmp_path / "ckpt"))
    proc = _elastic_run(*command, "--etcd", etcd.endpoint, "--job-id", f"{parent}/b", *script)
    assert proc.returncode == 2, proc.stderr
    assert _error_line(proc) == (
        f"the job id ('{parent}/b') must be non-empty, without '/' or surrounding spaces; "
        "pass --job-id.")
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)))
    try:
        assert client.get_prefix(f"/elastic/{parent}") == []
    finally:
        client.close()
    assert not out.exists()
