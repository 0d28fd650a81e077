"""launch.standby: warm standby interpreters, handed a world, become the worker (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from launch.standby import DEFAULT_PRELOAD, StandbyPool, standby_state
from tests.support import proctree

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl"),
]

REPO = Path(__file__).resolve().parents[3]
GUARD = (sys.executable, "-u", "-m", "launch.worker_guard")

# The worker: what it finds in the process it runs in, as one JSON line.
SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    preloaded = "torch" in sys.modules
    mine = "standby_test_helper" in sys.modules
    import torch
    with open(sys.argv[1], "w") as out:
        json.dump({
            "pid": os.getpid(), "argv": sys.argv[2:], "name": __name__,
            "rank": os.environ.get("RANK"), "world": os.environ.get("WORLD_SIZE"),
            "local_rank": os.environ.get("LOCAL_RANK"),
            "torch_preloaded": preloaded, "user_module_preloaded": mine,
            "cuda_initialized": torch.cuda.is_initialized(),
            "libcuda_mapped": "libcuda" in open("/proc/self/maps").read(),
            "comm": open("/proc/self/comm").read().strip(),
            "path0": sys.path[0],
        }, out)
""")


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["ELASTIC_AGENT_PID"] = str(os.getpid())  # the test process is the "agent"
    env.update(extra)
    return env


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture
def pool_factory() -> Iterator[object]:
    pools: list[StandbyPool] = []

    def make(env: Mapping[str, str], preload: tuple[str, ...] | None = None) -> StandbyPool:
        pool = StandbyPool(sys.executable, 1, lambda rank: {**env, "LOCAL_RANK": str(rank)},
                           refill_delay=3600.0, preload=preload)
        pools.append(pool)
        pool.tick()
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.mark.timeout(120)
def test_a_worker_runs_in_its_ready_standby_with_its_world_and_no_cuda(
    tmp_path: Path, pool_factory: object
) -> None:
    script, out = tmp_path / "worker.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    env = _base_env()
    pool = pool_factory(env)  # type: ignore[operator]
    (standby,) = pool.pids()
    _wait(lambda: standby_state(standby) == "ready", 90, "the standby to finish importing")
    proc = pool.take(0, {**env, "LOCAL_RANK": "0", "RANK": "5", "WORLD_SIZE": "6"},
                     (*GUARD, str(script), str(out), "--flag"))
    assert proc is not None and proc.pid == standby
    assert proc.wait(timeout=60) == 0
    seen = json.loads(out.read_text())
    assert seen["pid"] == standby  # the restarted worker is the standby process itself
    assert (seen["rank"], seen["world"], seen["local_rank"]) == ("5", "6", "0")
    assert seen["argv"] == ["--flag"] and seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path)  # as `python script.py` would have it
    assert seen["torch_preloaded"] and not seen["user_module_preloaded"]
    assert not seen["cuda_initialized"] and not seen["libcuda_mapped"]
    assert seen["comm"] not in ("elastic-standby", "elastic-warming")
    assert pool.handed_over == 1 and pool.pids() == []


@pytest.mark.timeout(120)
def test_default_preload_initialises_no_cuda_and_imports_no_user_code(tmp_path: Path) -> None:
    # What the standby imports, measured in a process that imports exactly that list.
    probe = textwrap.dedent(f"""
        import json, sys
        import torch  # queues its own lazy CUDA checks, run only when CUDA initialises
        queued = len(torch.cuda._queued_calls)
        from launch.standby import preload, cuda_initialised
        missing = preload({list(DEFAULT_PRELOAD)!r})
        print(json.dumps({{
            "missing": missing, "cuda": cuda_initialised(),
            "lazy_cuda_untouched": (not torch.cuda._initialized
                                    and len(torch.cuda._queued_calls) == queued),
            "libcuda": "libcuda" in open("/proc/self/maps").read(),
            "outside_torch": sorted(m for m in sys.modules if m.split(".")[0] in
                                    ("elastic", "checkpointing", "launch")),
        }}))
    """)
    done = subprocess.run([sys.executable, "-c", probe], env=_base_env(), capture_output=True,
                          text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["missing"] == []
    assert not seen["cuda"] and seen["lazy_cuda_untouched"] and not seen["libcuda"]
    # Of this project, only what launch.standby itself imports.
    assert seen["outside_torch"] == ["elastic", "elastic.env", "launch", "launch.standby"]


@pytest.mark.timeout(120)
def test_a_standby_whose_imports_initialised_cuda_runs_the_worker_in_a_fresh_image(
    tmp_path: Path, pool_factory: object
) -> None:
    # A preloaded module that (pretends to have) initialised CUDA: the standby says so, the
    # pool keeps no more standbys, and the world it is handed runs in a fresh exec'd image.
    (tmp_path / "standby_test_helper.py").write_text(
        "import torch\ntorch.cuda.is_initialized = lambda: True\n")
    script, out = tmp_path / "worker.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    env = _base_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}")
    pool = pool_factory(env, preload=("standby_test_helper",))  # type: ignore[operator]
    (standby,) = pool.pids()
    _wait(lambda: standby_state(standby) == "ready", 90, "the standby to finish importing")
    _wait(lambda: (pool.tick(), pool.disabled is not None)[1], 10, "the pool to hear of CUDA")
    assert "CUDA" in (pool.disabled or "")
    proc = pool.take(0, {**env, "LOCAL_RANK": "0", "RANK": "1"}, (*GUARD, str(script), str(out)))
    assert proc is not None and proc.wait(timeout=60) == 0
    seen = json.loads(out.read_text())
    assert seen["pid"] == standby and seen["rank"] == "1"
    assert not seen["user_module_preloaded"] and not seen["torch_preloaded"]
    assert not seen["cuda_initialized"]
    pool.tick()
    assert pool.pids() == []  # disabled: no replacement standby


@pytest.mark.timeout(60)
def test_a_changed_environment_starts_cold_and_replaces_the_standby(
    tmp_path: Path, pool_factory: object
) -> None:
    env = _base_env()
    pool = pool_factory(env, preload=())  # type: ignore[operator]
    (standby,) = pool.pids()
    changed = {**env, "LOCAL_RANK": "0", "OMP_NUM_THREADS": "7", "RANK": "0"}
    assert pool.take(0, changed, (*GUARD, "x.py")) is None
    _wait(lambda: not proctree.alive(standby), 10, "the stale standby to be stopped")
    pool.tick()
    assert len(pool.pids()) == 1 and pool.pids() != [standby]
    # A command a standby cannot run (--exec) always starts cold, and keeps the standby.
    assert not StandbyPool.supports((*GUARD, "--exec", "echo"))
    assert pool.take(0, {**env, "LOCAL_RANK": "0"}, (*GUARD, "--exec", "echo")) is None


@pytest.mark.timeout(60)
def test_a_standby_dies_with_its_agent(tmp_path: Path) -> None:
    agent = textwrap.dedent("""
        import os, sys, time
        from launch.standby import StandbyPool
        env = dict(os.environ, ELASTIC_AGENT_PID=str(os.getpid()))
        pool = StandbyPool(sys.executable, 1, lambda rank: env, preload=())
        pool.tick()
        print(pool.pids()[0], flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", agent], env=_base_env(), text=True,
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        standby = int(proc.stdout.readline())
        _wait(lambda: standby_state(standby) == "ready", 30, "the standby to start")
        os.kill(proc.pid, signal.SIGKILL)  # the agent alone, as an OOM kill would
        proc.wait(timeout=10)
        _wait(lambda: not proctree.alive(standby), 10, "the standby to die with its agent")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
