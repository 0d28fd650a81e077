"""benchmarks/gpu_training.py: how a stall and a step-time ratio are computed, and its
``--smoke`` mode end to end on the CPU (the same worker code under elastic-run, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_training
from benchmarks.gpu_training import block_ratio, stalls, summarize

REPO = Path(__file__).resolve().parents[3]


def test_a_stall_is_the_extra_time_of_the_steps_around_a_save_over_the_typical_step() -> None:
    steps = [0.040] * 30
    steps[10] += 0.030  # a save after step 10: its call, then the copy the next step waits for
    steps[11] += 0.020
    steps[25] += 0.005  # a save near the end: its window is cut by the phase's end
    steps[28] += 0.001
    typical, each = stalls(steps, [10, 25])
    assert typical == pytest.approx(0.040)
    assert each == pytest.approx([0.050, 0.006])
    # A slow step outside every window is not charged to a save (the median ignores it).
    steps[3] += 0.5
    assert stalls(steps, [10, 25]) == (pytest.approx(0.040), pytest.approx([0.050, 0.006]))


def test_the_step_time_ratio_is_per_round_against_the_same_rounds_plain_blocks() -> None:
    blocks = [
        {"round": 0, "config": "plain", "steps": [0.040, 0.040]},
        {"round": 0, "config": "loop", "steps": [0.0401, 0.0401]},
        {"round": 1, "config": "loop", "steps": [0.0412, 0.0412]},
        {"round": 1, "config": "plain", "steps": [0.041, 0.041]},
        {"round": 2, "config": "plain", "steps": [0.040, 0.040]},
        {"round": 2, "config": "loop", "steps": [0.0404, 0.0404]},
    ]
    ratio = block_ratio(blocks, "loop")
    assert ratio is not None
    assert ratio[1] == pytest.approx([1.0025, 0.0412 / 0.041, 1.01])
    assert ratio[0] == pytest.approx(0.0412 / 0.041)  # the median round
    assert block_ratio(blocks, "loop_host_wait") is None


def test_the_summary_holds_each_goal_against_the_same_runs_floor() -> None:
    worker = {
        "phases": [
            {"name": "plain r0", "kind": "block", "config": "plain", "round": 0,
             "steps": [0.04] * 4, "boundaries": [], "interval": 0, "deferred": 0},
            {"name": "loop r0", "kind": "block", "config": "loop", "round": 0,
             "steps": [0.04004] * 4, "boundaries": [], "interval": 0, "deferred": 0},
            {"name": "ours every 1 s", "kind": "saves", "interval": 25, "round": 0,
             "config": "", "steps": [0.04] * 40, "boundaries": [5, 30], "deferred": 1},
        ],
        "floor_s": [0.06, 0.06, 0.07], "state_bytes": 2 << 30, "warmup_steps": [0.05, 0.04],
        "reserve_wait_after_warmup_s": 0.0,
    }
    worker["phases"][2]["steps"][5] += 0.1  # 1.67x the floor: over the goal
    summary = summarize(worker, [{"stall_s": 0.1}])
    assert summary["steps"]["loop"]["ratio"] == pytest.approx(1.001)
    assert summary["goals"] == {"loop step / plain DDP <= 1.003": True,
                                "ours every 1 s: every stall <= 1.5x floor": False}
    assert summary["saves"]["ours every 1 s"]["stalls_over_floor"] == pytest.approx(
        [0.1 / 0.06, 0.0])
    assert summary["loop_recorded_stall_s"] == [0.1]


def test_without_cuda_it_says_so_and_exits_0(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run")
    out = tmp_path / "out.json"
    assert gpu_training.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"skipped": gpu_training.SKIPPED}


@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.timeout(400)
def test_the_smoke_run_measures_every_phase_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_training.py", "--smoke", "--json",
                           str(out), "--tmp-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Smoke run on the CPU: no goals" in done.stdout
    result = json.loads(out.read_text())
    worker, summary = result["worker"], result["summary"]
    assert worker["skipped"] == [] and worker["fence"] == "none (gloo)"
    cfg = gpu_training.Config.smoke_config()
    blocks = [p for p in worker["phases"] if p["kind"] == "block"]
    assert [len(b["steps"]) for b in blocks] == [cfg.block_steps] * 2 * cfg.rounds
    assert list(summary["saves"]) == ["ours every 0.3 s", "DCP every 0.3 s", "ours every 0.1 s",
                                      "DCP every 0.1 s", "ours every 0.1 s, wait policy"]
    for name, saves in summary["saves"].items():
        assert saves["stalls_s"], f"{name}: no save was measured"
    # The loop recorded a stall for each of its overlapped saves.
    ours = sum(len(s["stalls_s"]) for n, s in summary["saves"].items() if n.startswith("ours"))
    assert len(summary["loop_recorded_stall_s"]) == ours
    assert list(tmp_path.glob("gpu-training-bench-*")) == []  # removed at the end
