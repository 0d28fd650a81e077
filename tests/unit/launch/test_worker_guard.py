"""launch.worker_guard: runs a target like python would, and dies with its parent."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.pop("ELASTIC_AGENT_PID", None)
    env.update(extra)
    return env


def test_script_runs_as_main_with_its_argv_path_and_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import sys
        print(__name__, sys.argv[1:], sys.path[0])
        sys.exit(7)
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "launch.worker_guard", str(script), "a", "--b"],
        env=_env(), capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout.split() == ["__main__", "['a',", "'--b']", str(tmp_path)]


def test_module_and_exec_modes_run_the_target(tmp_path: Path) -> None:
    (tmp_path / "modtarget.py").write_text("import sys; print('mod', sys.argv[1:])\n")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.worker_guard", "-m", "modtarget", "x"],
        env=_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}"), capture_output=True, text=True,
        timeout=60, cwd=tmp_path,
    )
    assert proc.stdout.strip() == "mod ['x']", proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "launch.worker_guard", "--exec", "echo", "hello"],
        env=_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.stdout.strip() == "hello"


def test_missing_target_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launch.worker_guard"], env=_env(), capture_output=True,
        text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "usage: python -m launch.worker_guard" in proc.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent, init, reaps it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_worker_dies_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import os, time
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """))
    # The parent plays the agent: it starts the guarded worker in a new session (as torch does).
    parent_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, ELASTIC_AGENT_PID=str(os.getpid()))
        subprocess.Popen([sys.executable, "-m", "launch.worker_guard", {str(child)!r}],
                         env=env, start_new_session=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=_env(), cwd=REPO)
    worker_pid = 0
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "the guarded worker never started"
            time.sleep(0.1)
        worker_pid = int(pidfile.read_text())
        assert _alive(worker_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), "the worker outlived its agent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if worker_pid and _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_worker_refuses_to_start_when_its_agent_is_already_gone(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("print('trained without an agent')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.worker_guard", str(script)],
        env=_env(ELASTIC_AGENT_PID="1"), capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 1
    assert "trained without an agent" not in proc.stdout
    assert re.search(r"the agent \(pid 1\) is already gone", proc.stderr)
