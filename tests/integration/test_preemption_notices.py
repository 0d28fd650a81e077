"""A real process hears a preemption notice: fake IMDS/GCP servers on 127.0.0.1, real SIGTERM.

Runs ``python -m launch.preemption`` as a child process (the same watchers the agent uses) and
checks what it prints and how it exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic import env
from tests.unit.launch.test_preemption_fakes import FakeState, serve

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def _watcher(
    *args: str, extra_env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    child_env.update(extra_env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.preemption", *args], cwd=ROOT, env=child_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _ready(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"watcher exited early: {proc.stderr.read() if proc.stderr else ''}"
    return list(json.loads(line)["ready"])


def _notice(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_node_process_hears_the_aws_spot_notice_from_imds() -> None:
    dead = _closed_port_url()
    with serve("aws") as (url, state), _watcher(
        "--watch", "auto", "--gcp-url", dead, "--azure-url", dead,
        extra_env={env.AWS_METADATA_URL: url},  # the URL comes from the environment here
    ) as proc:
        assert _ready(proc) == ["aws", "sigterm"]
        state.preempt()
        notice = _notice(proc)
    assert notice["source"] == "aws"
    assert notice["deadline"] == "2030-01-01T00:02:00+00:00"


def test_a_node_process_hears_gcp_preemption_through_the_long_poll() -> None:
    with serve("gcp", FakeState()) as (url, state), _watcher(
        "--watch", "gcp", "--gcp-url", url
    ) as proc:
        assert _ready(proc) == ["gcp"]
        state.preempt()
        notice = _notice(proc)
    assert notice == {**notice, "source": "gcp", "detail": "preempted=TRUE"}


def test_sigterm_becomes_a_notice_instead_of_killing_the_process() -> None:
    with _watcher("--watch", "sigterm", "--grace-period", "90") as proc:
        assert _ready(proc) == ["sigterm"]
        proc.send_signal(signal.SIGTERM)
        notice = _notice(proc)
    assert notice["source"] == "sigterm" and notice["deadline"] is not None


def test_a_node_outside_any_cloud_does_not_hang_and_gives_up_at_its_timeout() -> None:
    dead = _closed_port_url()
    with _watcher("--watch", "auto", "--aws-url", dead, "--gcp-url", dead, "--azure-url", dead,
                  "--timeout", "0.5") as proc:
        assert _ready(proc) == ["sigterm"]
        proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 1


def test_an_unknown_source_is_refused_with_a_clear_message() -> None:
    with _watcher("--watch", "aws,oracle") as proc:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 2
    assert "'oracle'" in out and "aws,gcp,azure,sigterm" in out
