"""benchmarks/run_all.py: summary rows from each script's JSON, goals, failures, the runner.

The fixtures are built with the scripts' own dataclasses (``asdict`` of the ``Run`` /
``RoundResult`` they write) or their own JSON function, so a change of shape in a script fails
here rather than in a published table.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from benchmarks import run_all
from benchmarks.goodput_under_faults import Run as GoodputRun
from benchmarks.inplace_vs_torchrun import Run as InplaceRun
from benchmarks.loop_overhead import Result as LoopResult
from benchmarks.loop_overhead import schedule as loop_schedule
from benchmarks.metrics_overhead import Result as MetricsResult
from benchmarks.metrics_overhead import schedule as metrics_schedule
from benchmarks.recovery_vs_torchrun import Run as RecoveryRun
from benchmarks.rendezvous_scale import LoadResult, RoundResult, predicted_load
from benchmarks.sampler_memory import Case as SamplerCase
from tests.support import proctree

REPO = Path(__file__).resolve().parents[3]

# What `rendezvous_scale.py --nodes 2 --processes 2 --steady 1` printed on this machine.
RDZV_STDOUT = "\n".join([
    "elastic-run N=   2 round      0.14  CAS     4 (generation 1, leader 2, world 1)  world "
    "412 B  errors 0",
    "                   keep-alives/s 2.0 (predicted 2.0)  watches 3 (predicted 3)  loss "
    "round 0.009389877319335938",
    "c10d        N=   2 round      1.08  CAS     2 (lost 0)  errors 0",
    "",
    "Rendezvous of N simulated nodes (2 processes, 8 worker slots per node record, one etcd, "
    "cap 60 s per round, 1 repeat(s), medians).",
    "",
    "| N | elastic-run round (s) | c10d round (s) | elastic-run / c10d | elastic-run CAS "
    "attempts: generation + leader + world = total (per node) | c10d CAS attempts (lost) |",
    "|---|---|---|---|---|---|",
    "| 2 | 0.14 | 1.08 | 0.13 | 1 + 2 + 1 = 4 (2.00) | 2 (0) |",
    "",
    "- CAS attempts per round: elastic-run 2.00/node at N=2: O(N)",
    "",
])


def _rdzv(rounds: list[RoundResult], loads: tuple[LoadResult, ...] = ()) -> dict[str, Any]:
    """The JSON ``rendezvous_scale.py --json`` writes."""
    return json.loads(json.dumps({"rounds": [asdict(r) for r in rounds],
                                  "loads": [asdict(x) for x in loads]}))


def _one(rows: list[run_all.Row], measure_part: str, baseline: str) -> run_all.Row:
    found = [r for r in rows if r.measure.startswith(measure_part)
             and r.baseline_name == baseline]
    assert len(found) == 1, [(r.measure, r.baseline_name) for r in rows]
    return found[0]


# ------------------------------------------------------------------------------ checkpoint


def _timing(blocking: float, durable: float) -> Any:
    from benchmarks.checkpoint_throughput import Timing

    t = Timing()
    t.add(blocking, durable)
    t.add(blocking * 3, durable * 3)  # the median of three must be taken, not the mean
    t.add(blocking, durable)
    return t


def _checkpoint_json(s3_ours: float) -> dict[str, Any]:
    from benchmarks.checkpoint_throughput import results_json

    local = {
        run_all.CKPT_COPY_FLOOR: _timing(0.10, 0.10),
        run_all.CKPT_DISK_FLOOR: _timing(1.00, 1.00),
        "torch.save + fsync": _timing(2.0, 2.0),
        "DCP save": _timing(2.5, 2.5),
        run_all.CKPT_DCP_ASYNC: _timing(1.20, 3.00),
        run_all.CKPT_OURS: _timing(0.12, 1.50),
    }
    s3 = {run_all.CKPT_S3_RAW: _timing(2.0, 2.0), run_all.CKPT_S3_RAW_ZERO_COPY: _timing(1.6, 1.6),
          run_all.CKPT_S3_OURS: _timing(0.1, s3_ours)}
    data = {"repeats": 3, "settle": 1.0,
            **results_json([(300, 300 * run_all.MiB, local)], (300, 300 * run_all.MiB, s3))}
    loaded: dict[str, Any] = json.loads(json.dumps(data))  # as read back from the file
    return loaded


def test_checkpoint_rows_ratios_and_goals() -> None:
    rows = run_all.checkpoint_rows(_checkpoint_json(s3_ours=2.5))

    block = _one(rows, "blocking", "copy floor")
    assert block.ours == pytest.approx(0.12) and block.baseline == pytest.approx(0.10)
    assert block.ratio == pytest.approx(1.2)
    assert block.met is True  # 1.2 <= 1.5

    durable = _one(rows, "durable (fsynced", "disk floor")
    assert durable.ratio == pytest.approx(1.5)
    assert durable.met is False  # 1.5 > 1.3

    dcp_block = _one(rows, "blocking", "DCP async_save")
    assert dcp_block.speedup and dcp_block.ratio == pytest.approx(10.0)  # 1.2 / 0.12
    assert dcp_block.goal == "" and dcp_block.met is None
    assert _one(rows, "durable (fsynced", "DCP async_save").ratio == pytest.approx(2.0)

    s3 = _one(rows, "durable on S3", "raw s3fs puts, 4 in parallel")
    assert s3.ratio == pytest.approx(1.25) and s3.met is True
    assert "300 MiB" in s3.measure
    floor = _one(rows, "durable on S3", "the same puts, zero-copy body")
    assert floor.ratio == pytest.approx(2.5 / 1.6) and floor.goal == "" and floor.met is None


def test_checkpoint_s3_goal_missed_and_rendered() -> None:
    rows = run_all.checkpoint_rows(_checkpoint_json(s3_ours=3.0))
    s3 = _one(rows, "durable on S3", "raw s3fs puts, 4 in parallel")
    assert s3.ratio == pytest.approx(1.5) and s3.met is False

    line = run_all.render_row(s3)
    assert "| 3.00 s |" in line and "2.00 s (raw s3fs puts, 4 in parallel)" in line
    assert "1.50 (ours / baseline)" in line and line.endswith("| **no** |")
    assert run_all.render_row(_one(rows, "blocking", "copy floor")).endswith("| yes |")
    assert "10.0x faster (baseline / ours)" in run_all.render_row(
        _one(rows, "blocking", "DCP async_save"))


def test_checkpoint_names_are_the_scripts() -> None:
    """The method names run_all looks up are the ones checkpoint_throughput.py writes."""
    source = (REPO / "benchmarks" / "checkpoint_throughput.py").read_text()
    for name in (run_all.CKPT_COPY_FLOOR, run_all.CKPT_DISK_FLOOR, run_all.CKPT_DCP_ASYNC,
                 run_all.CKPT_OURS, run_all.CKPT_S3_RAW, run_all.CKPT_S3_RAW_ZERO_COPY,
                 run_all.CKPT_S3_OURS):
        assert f'"{name}"' in source


@pytest.mark.slow
def test_checkpoint_script_json_feeds_the_summary(tmp_path: Path) -> None:
    """A real (tiny) run of checkpoint_throughput.py --json gives every local row."""
    out = tmp_path / "ckpt.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_throughput.py", "--sizes", "1", "--repeats",
         "1", "--s3-size", "0", "--settle", "0", "--tmp-dir", str(tmp_path), "--json",
         str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| size | method |" in done.stdout  # its own table still printed
    data = json.loads(out.read_text())
    assert data["repeats"] == 1 and data["s3"] is None
    rows = run_all.checkpoint_rows(data)
    assert {r.baseline_name for r in rows} == {"copy floor", "disk floor", "DCP async_save"}
    assert all(r.ratio is not None and r.ratio > 0 for r in rows)
    assert all(isinstance(r.met, bool) for r in rows if r.goal)


# ------------------------------------------------------------------------- cuda checkpoint


def test_cuda_checkpoint_rows_from_the_scripts_json() -> None:
    from benchmarks import cuda_checkpoint

    timings = {
        cuda_checkpoint.FLOOR: _timing(0.40, 0.40),
        cuda_checkpoint.OURS: _timing(0.52, 9.0),
        cuda_checkpoint.DCP_CACHED: _timing(2.6, 12.0),
        cuda_checkpoint.DCP_STAGER: _timing(0.65, 11.0),
    }
    data = json.loads(json.dumps({"repeats": 3, "settle": 1.0, "device": "NVIDIA H100",
                                  "sizes": cuda_checkpoint.results_json(
                                      [(16.0, 16 << 30, timings, {})])}))
    rows = run_all.cuda_checkpoint_rows(data)
    assert len(rows) == 3 and all("16.00 GiB" in r.measure for r in rows)
    floor = _one(rows, "blocking", "device-to-pinned-host copy floor")
    assert floor.ratio == pytest.approx(1.3) and floor.met is True  # 0.52 / 0.40 <= 1.5
    cached = _one(rows, "blocking", "async_save, cache_staged_state_dict=True")
    assert cached.speedup and cached.ratio == pytest.approx(5.0) and cached.met is None
    assert _one(rows, "blocking", "async_save, DefaultStager (pinned, non-blocking)"
                ).ratio == pytest.approx(1.25)
    # The names run_all looks up are the script's.
    assert (run_all.CUDA_FLOOR, run_all.CUDA_OURS, run_all.CUDA_DCP_CACHED,
            run_all.CUDA_DCP_STAGER) == (cuda_checkpoint.FLOOR, cuda_checkpoint.OURS,
                                         cuda_checkpoint.DCP_CACHED, cuda_checkpoint.DCP_STAGER)


def test_a_cuda_baseline_that_failed_has_no_row_and_its_reason_stays_in_the_json() -> None:
    from benchmarks import cuda_checkpoint

    timings = {cuda_checkpoint.FLOOR: _timing(0.34, 0.34),
               cuda_checkpoint.OURS: _timing(0.35, 25.0),
               cuda_checkpoint.DCP_CACHED: _timing(0.39, 20.0)}
    failed = {cuda_checkpoint.DCP_STAGER: "KeyError: <class 'type'>"}
    sizes = cuda_checkpoint.results_json([(16.0, 16 << 30, timings, failed)])
    assert sizes[0]["failed"] == failed
    rows = run_all.cuda_checkpoint_rows({"sizes": sizes})
    assert len(rows) == 2 and not any("DefaultStager" in r.baseline_name for r in rows)
    report = cuda_checkpoint.report([(16.0, 16 << 30, timings, failed)], "header")
    assert "| DCP async_save, DefaultStager (pinned, non-blocking) | failed: KeyError" in report


def test_cuda_checkpoint_without_a_gpu_is_reported_as_skipped_not_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, even on a machine with one
    bench = _bench("cuda_checkpoint")
    outcome = run_all.run_bench(bench, bench.quick, tmp_path, 300)
    assert outcome.status == "ok" and outcome.returncode == 0
    assert outcome.stdout_path.read_text().strip() == (
        "cuda_checkpoint: skipped: no CUDA device (torch.cuda.is_available() is False)")
    (row,) = run_all.summarize(outcome)
    assert row.skipped == "no CUDA device" and not row.failed
    assert run_all.render_row(row) == (
        "| cuda_checkpoint | skipped: no CUDA device | - | - | - | - | skipped |")


# ------------------------------------------------------------------------------ rendezvous


def test_rendezvous_rows_from_a_real_tiny_run() -> None:
    load = LoadResult(nodes=2, workers=8, window_s=1.0, keepalives_per_s=1.9977,
                      watches=3, watch_streams_per_s=0.0, other_requests_per_s=0.0,
                      predicted=predicted_load(2, ttl=3))
    data = _rdzv([RoundResult("elastic-run", 2, 0.13818, 2, 60.0, 4, 1),
                  RoundResult("c10d", 2, 1.07648, 2, 60.0, 2, 0)], (load,))
    rows = run_all.rendezvous_rows(data, RDZV_STDOUT)
    vs_c10d = _one(rows, "round time, N=2", "c10d")
    assert vs_c10d.ratio == pytest.approx(0.13818 / 1.07648)
    assert not vs_c10d.speedup and vs_c10d.goal == ""
    beats = _one(rows, "keep-alives/s at N=2", "computed")
    assert beats.ours == pytest.approx(1.9977) and beats.baseline == pytest.approx(2.0)


def test_rendezvous_incomplete_rounds_and_the_goals() -> None:
    rounds = [RoundResult(b, n, t, done, 60.0, 10, 0) for b, n, t, done in (
        ("elastic-run", 128, 1.0, 128), ("elastic-run", 128, 3.0, 128),
        ("elastic-run", 128, 2.0, 128), ("c10d", 128, 4.0, 128),
        ("elastic-run", 256, 3.0, 256), ("c10d", 256, None, 17),
        ("elastic-run", 1024, None, 1000))]
    rows = run_all.rendezvous_rows(_rdzv(rounds), "")
    assert [r.measure for r in rows] == ["round time, N=128, median",
                                         "round time, N=256, median",
                                         "round time, N=1024, median"]
    at128, at256, at1024 = rows
    assert at128.ours == 2.0 and at128.ratio == pytest.approx(0.5)
    assert at128.goal == "<= c10d" and at128.met is True
    assert at256.baseline is None and at256.baseline_note == "incomplete: 17 of 256 nodes in 60 s"
    assert at1024.ours is None and at1024.ours_note == "incomplete: 1000 of 1024 nodes in 60 s"
    assert at1024.baseline_note == "not run: incomplete at a smaller N"
    assert at1024.goal == "< 10 s" and at1024.met is False
    assert "**no**" in run_all.render_row(at1024)


# -------------------------------------------------------------------------------- recovery


def test_recovery_rows_speedup_and_a_baseline_that_hung() -> None:
    runs = [asdict(r) for r in (
        RecoveryRun("torchrun-default", {"first_step": 5.0}, ["worker_kill"]),
        RecoveryRun("torchrun-default", {"first_step": 5.0}, ["worker_kill"]),
        RecoveryRun("torchrun-noshare", {"worker_kill": 6.0, "node_loss": 40.0}),
        RecoveryRun("torchrun-noshare", {"worker_kill": 8.0, "node_loss": 50.0}),
        RecoveryRun("elastic-run", {"worker_kill": 2.0, "node_loss": 5.0}),
        RecoveryRun("elastic-run", {"worker_kill": 2.0}, ["node_loss"]),
    )]
    rows = run_all.recovery_rows(runs)
    assert len(rows) == 4
    hung = _one(rows, "worker SIGKILL", "torchrun")
    assert hung.baseline is None and hung.ratio is None
    assert hung.baseline_note == "0 of 2 runs, 2 hung"
    assert "- (torchrun; 0 of 2 runs, 2 hung)" in run_all.render_row(hung)
    noshare_kill = _one(rows, "worker SIGKILL", "torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    assert noshare_kill.speedup and noshare_kill.ratio == pytest.approx(3.5)  # 7.0 / 2.0
    noshare_loss = _one(rows, "node loss", "torchrun, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    assert noshare_loss.ours == 5.0 and noshare_loss.ours_note == "1 of 2 runs, 1 hung"
    assert noshare_loss.ratio == pytest.approx(9.0)  # 45 / 5


def test_recovery_without_elastic_run_gives_no_rows() -> None:
    runs = [asdict(RecoveryRun("torchrun-default", {"worker_kill": 6.0}))]
    assert run_all.recovery_rows(runs) == []


# --------------------------------------------------------------------------------- restart


def test_restart_rows_goals_and_speedup_from_the_scripts_json() -> None:
    from benchmarks.restart_path import Fault, Run

    def run(launcher: str, worker: float | None, node: float | None) -> dict[str, Any]:
        faults = {"worker": Fault(stall=worker), "node": Fault(stall=node, note="hung")}
        return asdict(Run(launcher, 0, faults))

    runs = [run("elastic-run", 1.0, 2.0), run("elastic-run", 3.0, None),
            run("elastic-run", 1.5, 4.0), run("torchrun", 6.0, 12.0)]
    rows = run_all.restart_rows(runs)
    worker = _one(rows, "worker SIGKILL", "torchrun")
    assert worker.ours == 1.5 and worker.met is True and worker.ratio == pytest.approx(4.0)
    node = _one(rows, "node SIGKILL", "torchrun")
    assert node.ours == pytest.approx(3.0) and node.met is True  # median of 2.0 and 4.0
    assert node.ours_note == "2 of 3 runs"
    slow = run_all.restart_rows([run("elastic-run", 2.5, 3.5)])
    assert [r.met for r in slow] == [False, False] and slow[0].baseline is None
    assert run_all.restart_rows([run("torchrun", 6.0, 12.0)]) == []
    # The caches turned off: one more row per fault, against the same torchrun, no goal.
    rows = run_all.restart_rows([*runs, run("elastic-run-off", 8.0, 9.0)])
    cold = _one(rows, "worker SIGKILL: survivors' stall, restart mode, plain script, warm",
                "torchrun")
    assert cold.ours == 8.0 and cold.ratio == pytest.approx(0.75) and cold.goal == ""
    assert cold.met is None and len(rows) == 4


# --------------------------------------------------------------------------------- inplace


def test_inplace_rows() -> None:
    runs = [asdict(r) for r in (
        InplaceRun("torchrun", {"worker_kill": 6.0, "node_loss": 40.0},
                   {"worker_kill": 10, "node_loss": 12}),
        InplaceRun("elastic-run-restart", {"worker_kill": 5.0, "node_loss": 8.0},
                   {"worker_kill": 10, "node_loss": 10}),
        InplaceRun("elastic-run-inplace", {"worker_kill": 0.2, "node_loss": 2.5},
                   {"worker_kill": 0, "node_loss": 0}),
    )]
    rows = run_all.inplace_rows(runs)
    inplace_loss = _one(rows, "node loss: recovery, in place", "torchrun")
    assert inplace_loss.ratio == pytest.approx(16.0)
    assert _one(rows, "worker SIGKILL: recovery, restart mode", "torchrun").ratio == \
        pytest.approx(1.2)
    redone = _one(rows, "node loss: steps redone", "torchrun")
    assert redone.ours == 0 and redone.baseline == 12
    assert redone.ratio is None or redone.ratio == 0  # no speed-up of a zero
    assert "| 0 steps |" in run_all.render_row(redone)


# --------------------------------------------------------------------------------- metrics


def test_metrics_rows_compare_with_metrics_off_against_the_one_percent_goal() -> None:
    data = {"pair_ratios": [0.99, 1.02, 1.0], "steps_per_block": 100, "on_median_s": 0.021,
            "ratio": 1.004, "cpu_ratio": 1.013, "cost_ratio": 1.002}
    cost, step, cpu = run_all.metrics_rows(data)
    assert cost.met is True and cost.ours == pytest.approx(1.002)
    assert step.met is True and step.ratio == pytest.approx(1.004)
    assert cpu.met is False and cpu.baseline_name == "metrics off, same run"
    assert "3 pairs of 100 steps, 21.0 ms steps" in run_all.render_row(step)


def test_metrics_script_json_feeds_the_summary() -> None:
    # The real script's JSON, from its own Result type (no run: that takes minutes).
    result = MetricsResult(steps_per_block=10, repeats=2, on_step_s=[0.02, 0.021],
                           off_step_s=[0.02, 0.02], on_cpu_s=[0.01, 0.01],
                           off_cpu_s=[0.01, 0.01], on_record_s=[2e-5, 2e-5],
                           agent_cpu_on_s=0.01, agent_wall_on_s=1.0, agent_wall_off_s=1.0)
    assert metrics_schedule(2) == [False, True, True, False]
    data = {**asdict(result), "on_median_s": result.on_median, "pair_ratios":
            result.pair_ratios, "ratio": result.ratio, "cpu_ratio": result.cpu_ratio,
            "cost_ratio": result.cost_ratio}
    cost, step, cpu = run_all.metrics_rows(json.loads(json.dumps(data)))
    # 20 us of recording plus the agent's 0.25 ms per worker, over 20 ms steps.
    assert cost.ours == pytest.approx(1 + (2e-5 + 2.5e-4) / 0.02)
    assert step.ours == pytest.approx(1.025)
    # The agent's 10 ms over 20 on-steps is 0.5 ms a step, 0.25 ms on each worker's 10 ms.
    assert cpu.ours == pytest.approx(1.025)


# ------------------------------------------------------------------------------------ loop


def test_loop_rows_compare_the_managed_loop_with_plain_ddp_against_the_goal() -> None:
    result = LoopResult(steps=300, warmup=50, blocks=[
        {"mode": "plain", "step_s": 1.4e-3, "cpu_s": 1.0e-3},
        {"mode": "managed", "step_s": 1.6e-3, "cpu_s": 1.1e-3},
        {"mode": "managed", "step_s": 2.0e-3, "cpu_s": 1.2e-3},
        {"mode": "plain", "step_s": 1.5e-3, "cpu_s": 1.0e-3}])
    data = json.loads(json.dumps({
        **asdict(result), "pair_overheads_s": result.pair_overheads_s,
        "overhead_s": result.overhead_s, "cpu_overhead_s": result.cpu_overhead_s}))
    step, cpu = run_all.loop_rows(data)
    assert result.pair_overheads_s == pytest.approx([0.2e-3, 0.5e-3])
    assert step.met is False and "+0.350 ms" in step.measure  # median of 0.2 and 0.5
    assert step.ours == pytest.approx(1.8e-3) and step.baseline == pytest.approx(1.45e-3)
    assert cpu.met is True and "+0.150 ms" in cpu.measure
    assert "| 1.800 ms (2 pairs of 300-step blocks) | 1.450 ms (plain DDP" in \
        run_all.render_row(step)
    assert loop_schedule(2) == ["plain", "managed", "managed", "plain"]


# ---------------------------------------------------------------------------- gpu training


def test_gpu_training_rows_hold_the_step_and_stall_goals_of_the_scripts_summary() -> None:
    from benchmarks.gpu_training import summarize

    def phase(name: str, kind: str, steps: list[float], **extra: Any) -> dict[str, Any]:
        return {"name": name, "kind": kind, "steps": steps, "boundaries": [], "interval": 25,
                "round": 0, "config": "", "deferred": 0, **extra}

    slow = [0.04] * 40
    slow[5] += 0.3  # DCP: 0.3 s
    ours = [0.04] * 40
    ours[5] += 0.05  # ours: 0.05 s against a 0.06 s floor
    worker = {"phases": [
        phase("plain r0", "block", [0.040] * 4, config="plain"),
        phase("loop r0", "block", [0.0401] * 4, config="loop"),
        phase("ours every 1 s", "saves", ours, boundaries=[5]),
        phase("DCP every 1 s", "saves", slow, boundaries=[5]),
        phase("ours every 1 s, wait policy", "saves", slow, boundaries=[5]),
    ], "floor_s": [0.06], "state_bytes": 1, "warmup_steps": [0.04],
        "reserve_wait_after_warmup_s": 0.0}
    data = json.loads(json.dumps({"worker": worker, "summary": summarize(worker, [])}))
    step, stall, versus_dcp = run_all.gpu_training_rows(data)
    assert step.met is True and "1.0025x" in step.measure
    assert stall.ours == pytest.approx(0.05) and stall.baseline == pytest.approx(0.06)
    assert stall.met is True and stall.goal == "<= 1.5x copy floor"
    assert versus_dcp.speedup and versus_dcp.ratio == pytest.approx(6.0)


# --------------------------------------------------------------------------------- goodput


def _goodput(launcher: str, goodput: float, training: float,
             reported: float | None = None) -> dict[str, Any]:
    return asdict(GoodputRun(launcher=launcher, faults=9, wall_s=310.0, steps=2900,
                             step_time_s=0.1, stopwatch_goodput=goodput, training_s=300.0,
                             stopwatch_training_goodput=training, reported_goodput=reported))


def _sharded_result() -> dict[str, Any]:
    # The shape sharded_recovery.py's main() builds and writes with --json.
    return {"state_mb": 226.5, "load": (1.0, 1.0, 1.0), "step_on_s": [3.0, 3.2, 3.02],
            "step_off_s": [3.0, 2.9, 3.0], "inplace_s": [4.0, 5.0, 6.0], "inplace_lost": [3, 0, 2],
            "restart-cold_s": [30.0, 36.0, 33.0], "restart-cold_lost": [2, 2, 2],
            "restart-cold_resumed_s": [28.0, 30.0, 29.0],
            "restart_s": [8.0, 9.0, 10.0], "restart_lost": [1, 1, 1],
            "restart_resumed_s": [4.0, 4.5, 5.0],
            "inplace_resumed_s": [1.0, 2.0, 1.5], "copy_stats": [],
            # The step time of the world after the fault, and the stall (the time to the next
            # step completed, less that step time; NaN when no second step came).
            "inplace_next_step_s": [2.5, 3.0, math.nan],
            "inplace_stall_s": [1.5, 2.0, math.nan],
            "restart-cold_next_step_s": [1.0, 1.0, 1.0],
            "restart-cold_stall_s": [29.0, 35.0, 32.0],
            "restart_next_step_s": [1.0, 1.0, 1.0], "restart_stall_s": [7.0, 8.0, 9.0]}


def test_sharded_rows_recovery_and_copies_against_the_same_runs_baselines() -> None:
    from benchmarks import sharded_recovery

    data = _sharded_result()
    (recovery, stall, resumed, lost, warm, warm_resumed, _warm_lost,
     step) = run_all.sharded_rows(data)
    # The goal is judged on the stall (the in-place world is smaller: its steps are longer).
    assert recovery.ours == 5.0 and recovery.baseline == 33.0 and recovery.met is None
    assert recovery.ratio == pytest.approx(5.0 / 33.0) and "226 MB" in recovery.measure
    assert recovery.baseline_name.startswith("cold restart + DCP load")
    assert stall.ours == 1.75 and stall.baseline == 32.0 and stall.met is True  # NaN skipped
    assert stall.goal == "<= 0.2x restart"
    assert resumed.ours == 1.5 and resumed.baseline == 29.0 and resumed.met is None
    assert lost.ours == 2 and lost.unit == "steps"
    # Today's warm restart path is shown beside it, with no goal.
    assert warm.baseline == 9.0 and warm.met is None and warm.goal == ""
    assert warm_resumed.baseline == 4.5
    assert step.ratio == pytest.approx(3.02 / 3.0) and step.met is True
    data["step_on_s"] = [3.1, 3.1, 3.1]
    assert run_all.sharded_rows(data)[-1].met is False  # 1.033x: over the 1 % goal
    # The script's own table reads the same dict.
    table = sharded_recovery.report(data)
    assert "| 5.00 | 33.00 (cold restart + DCP load from storage) | 0.152 | | |" in table
    assert "| 2.75 (5 ranks) | 1.00 (6 ranks) |" in table
    assert ("world** (s) | 1.75 | 32.00 | 0.055 | <= 0.2 | yes |" in table), table
    assert "| 5.00 | 9.00 (today's restart path" in table
    # The copies' own time against the training time: 2 refreshes of 60 ms blocking (+ 600
    # ms of transfers) in 100 steps of 3.02 s.
    data["step_on_s"] = [3.0, 3.2, 3.02]
    data["copy_stats"] = [{"rank": 0, "refreshes": 2, "blocking_ms": 60.0,
                           "exchange_ms": 600.0, "steps": 100}]
    table = sharded_recovery.report(data)
    assert "| copies' blocking time / training time | 0.04 % | | | <= 1 % | yes |" in table
    assert "| the same, background transfers counted as blocking | 0.44 % |" in table


def test_sharded_rows_of_an_older_json_read_its_restart_as_the_cold_path() -> None:
    data = {key: value for key, value in _sharded_result().items()
            if not key.startswith("restart")}
    data.update({"restart_s": [30.0, 36.0, 33.0], "restart_lost": [2, 2, 2],
                 "restart_resumed_s": [28.0, 30.0, 29.0]})
    recovery, _resumed, _lost, _step = run_all.sharded_rows(data)
    # Without a stall the goal is judged on the time to the next step completed.
    assert recovery.baseline == 33.0 and recovery.met is True


def test_sharded_rows_of_a_partial_run_give_only_what_was_measured() -> None:
    data = {**_sharded_result(), "inplace_s": []}  # --only steps
    (step,) = run_all.sharded_rows(data)
    assert step.baseline_name == "redundancy=0, same run"


def test_goodput_goal_needs_both_the_level_and_beating_torchrun() -> None:
    stdout = "Goodput, 3 nodes (CPU, gloo), a node killed every 30 s and replaced 5 s later"
    runs = [_goodput("elastic-run-inplace", 0.96, 0.96, reported=0.955),
            _goodput("elastic-run", 0.90, 0.93, reported=0.9),
            _goodput("torchrun", 0.50, 0.97)]
    rows = run_all.goodput_rows(runs, stdout)
    inplace = _one(rows, "goodput (stopwatch), in place", "torchrun")
    assert inplace.met is True and inplace.ratio == pytest.approx(0.96 / 0.50)
    assert "every 30 s" in inplace.measure and inplace.ours_note == "9 faults"
    # Above 0.95 but not above torchrun's 0.97: not met.
    assert _one(rows, "training goodput (stopwatch), in place", "torchrun").met is False
    assert _one(rows, "goodput (stopwatch), restart mode", "torchrun").met is False
    report = _one(rows, "goodput, elastic-run's own report vs the stopwatch, in place",
                  "stopwatch, same run")
    assert report.ratio == pytest.approx(0.955 / 0.96) and report.goal == ""
    assert len(rows) == 6


def test_goodput_without_torchrun_checks_the_level_only() -> None:
    rows = run_all.goodput_rows([_goodput("elastic-run-inplace", 0.97, 0.98)], "")
    assert [r.met for r in rows] == [True, True]
    assert all(r.baseline is None and r.ratio is None for r in rows)


# --------------------------------------------------------------------------------- sampler


def _sampler_json() -> dict[str, Any]:
    cases = [
        SamplerCase(10**6, "feistel", "ok", 16.0, 0.4, 0.5, 230.0, 0.002, 4e6),
        SamplerCase(10**6, "randperm sampler", "ok", 16.0, 40.0, 46.0, 230.0, 0.1, 1e6),
        SamplerCase(10**6, "randperm tensor", "ok", 16.0, 8.0, 8.0, 230.0, 0.05),
        SamplerCase(10**9, "feistel", "ok", 16.0, 0.4, 12.0, 230.0, 0.004, 4e6),
        SamplerCase(10**9, "randperm sampler", "out of memory", 16.0,
                    error="MemoryError under a 16 GiB address-space limit"),
        SamplerCase(10**9, "randperm tensor", "ok", 16.0, 7630.0, 7630.0, 230.0, 12.0),
    ]
    loaded: dict[str, Any] = json.loads(json.dumps(
        {"world": 8, "global_batch": 1024, "micro_batch": 128,
         "cases": [asdict(c) for c in cases]}))
    return loaded


def test_sampler_rows_memory_against_randperm_and_the_goal_at_a_billion() -> None:
    rows = run_all.sampler_rows(_sampler_json())
    small = _one(rows, "resident memory after the first batch, N=1e+06",
                 "torch.randperm sampler (before)")
    assert small.ratio == pytest.approx(0.01) and small.goal == "" and small.met is None
    tensor = _one(rows, "resident memory after the first batch, N=1e+09",
                  "torch.randperm tensor alone")
    assert tensor.ratio == pytest.approx(0.4 / 7630.0) and tensor.goal == "< 10 MB"
    # 12 MiB at its peak is over 10 MB: the goal counts the peak too.
    assert tensor.met is False
    assert "| 7.45 GiB (torch.randperm tensor alone) |" in run_all.render_row(tensor)
    failed = _one(rows, "resident memory after the first batch, N=1e+09",
                  "torch.randperm sampler (before)")
    assert failed.baseline is None and failed.ratio is None
    assert failed.baseline_note.startswith("out of memory: MemoryError under")
    first = _one(rows, "time to first batch, N=1e+06", "torch.randperm sampler (before)")
    assert first.speedup and first.ratio == pytest.approx(50.0)
    assert len(rows) == 6


@pytest.mark.slow
def test_sampler_script_json_feeds_the_summary(tmp_path: Path) -> None:
    """A real (tiny) run of sampler_memory.py --json: each case in its own process."""
    out = tmp_path / "sampler.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/sampler_memory.py", "--sizes", "1e9",
         "--orders", "feistel,randperm tensor", "--throughput", "5000",
         "--memory-limit-gib", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| N | order | status |" in done.stdout
    data = json.loads(out.read_text())
    cases = {(c["size"], c["order"]): c for c in data["cases"]}
    # 8 GB of randperm does not fit under 1 GiB: reported, not a crash.
    assert cases[(10**9, "randperm tensor")]["status"] == "out of memory"
    assert cases[(10**9, "feistel")]["status"] == "ok"
    rows = run_all.sampler_rows(data)
    at_a_billion = _one(rows, "resident memory after the first batch, N=1e+09",
                        "torch.randperm tensor alone")
    assert at_a_billion.met is True and at_a_billion.baseline is None
    assert at_a_billion.ours is not None and at_a_billion.ours < 10


# ------------------------------------------------------------------------ failures, render


def _outcome(tmp_path: Path, bench: run_all.Bench, status: str = "ok",
             returncode: int | None = 0, data: Any = None, stdout: str = "") -> run_all.Outcome:
    o = run_all.Outcome(bench, ("--runs", "1"), status, returncode, 12.0,
                        tmp_path / f"{bench.name}.stdout.md", tmp_path / f"{bench.name}.stderr",
                        tmp_path / f"{bench.name}.json")
    o.stdout_path.write_text(stdout)
    o.stderr_path.write_text("Traceback...\nRuntimeError: etcd did not start\n")
    if data is not None:
        o.json_path.write_text(json.dumps(data))
    return o


def _bench(name: str) -> run_all.Bench:
    return next(b for b in run_all.BENCHES if b.name == name)


def test_failed_and_timed_out_benchmarks_are_shown_as_failed(tmp_path: Path) -> None:
    failed = _outcome(tmp_path, _bench("recovery"), "failed", 1)
    (row,) = run_all.summarize(failed)
    assert row.failed.startswith("exit status 1 after 12 s")
    assert str(failed.stderr_path) in row.failed
    timed_out = _outcome(tmp_path, _bench("goodput"), "timed out", None)
    assert run_all.summarize(timed_out)[0].failed.startswith("timed out after 12 s")

    good = _outcome(tmp_path, _bench("checkpoint"), data=_checkpoint_json(2.0),
                    stdout="| size | method |\n|---|---|\n| 300 MiB | ours |\n")
    text = run_all.render([failed, good], "python benchmarks/run_all.py",
                          datetime.now(timezone.utc), 30.0, (1.0, 2.0), "full")
    summary = text.split("\n## ")[0]
    assert "| recovery | **failed**: exit status 1" in summary
    assert summary.count("| checkpoint |") == 6
    assert "RuntimeError: etcd did not start" in text  # the end of the failed log
    assert "## checkpoint: `checkpoint_throughput.py`" in text and "| 300 MiB | ours |" in text
    assert "- command: `python benchmarks/run_all.py`" in text
    assert f"{os.cpu_count()} CPUs (nproc)" in text and "torch " in text


def test_json_of_another_shape_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    bad = _outcome(tmp_path, _bench("checkpoint"), data={"local": [{"methods": {}}]})
    (row,) = run_all.summarize(bad)
    assert "could not be summarized" in row.failed and "KeyError" in row.failed
    missing = _outcome(tmp_path, _bench("rendezvous"))  # exit 0 but no JSON written
    assert run_all.summarize(missing)[0].failed.startswith("no readable JSON")
    empty = _outcome(tmp_path, _bench("recovery"), data=[])
    assert run_all.summarize(empty)[0].failed.startswith("no figures")


def test_markdown_detail_fences_progress_lines_only() -> None:
    text = run_all.markdown_detail(RDZV_STDOUT)
    assert text.startswith("```text\nelastic-run N=   2 round")
    assert "```\n\nRendezvous of N simulated nodes" in text
    assert "\n\n| N | elastic-run round (s) |" in text
    assert text.endswith("- CAS attempts per round: elastic-run 2.00/node at N=2: O(N)")
    one_line = "Checkpoint throughput, medians of 3.\n\n| a |\n|---|\n| 1 |"
    assert run_all.markdown_detail(one_line) == one_line


def test_select() -> None:
    assert [b.name for b in run_all.select("checkpoint,rendezvous")] == ["rendezvous",
                                                                         "checkpoint"]
    names = [b.name for b in run_all.select(None)]
    assert names == [b.name for b in run_all.BENCHES] and len(set(names)) == len(names)
    with pytest.raises(ValueError, match="nope"):
        run_all.select("rendezvous,nope")


# ---------------------------------------------------------------------- the runner, for real

_OK_SCRIPT = """\
import json, sys
print("| fake | table |")
print("progress", file=sys.stderr)
json.dump({"rounds": [{"backend": b, "nodes": 4, "round_s": t, "completed": 4, "cap_s": 60,
                       "cas_attempts": 8, "cas_lost": 0, "errors": 0, "detail": {}}
                      for b, t in (("elastic-run", 1.0), ("c10d", 2.0))], "loads": []},
          open(sys.argv[sys.argv.index("--json") + 1], "w"))
"""

_FAIL_SCRIPT = "import sys\nprint('it broke', file=sys.stderr)\nsys.exit(3)\n"

# Starts a grandchild in a session of its own (as the benchmarks start their agents), writes
# its pid, then waits forever.
_HANG_SCRIPT = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def _fake(name: str, script: str, rows: Any = run_all.rendezvous_rows) -> run_all.Bench:
    return run_all.Bench(name, script, ("--x",), ("--y",), 60, 60, rows)


def test_run_bench_failure_and_timeout_kill_the_whole_tree(tmp_path: Path) -> None:
    (tmp_path / "fail.py").write_text(_FAIL_SCRIPT)
    (tmp_path / "hang.py").write_text(_HANG_SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    failed = run_all.run_bench(_fake("fail", "fail.py"), [], work, 60, script_dir=tmp_path)
    assert failed.status == "failed" and failed.returncode == 3
    assert "it broke" in failed.stderr_path.read_text()

    pid_file = tmp_path / "grandchild.pid"
    hung = run_all.run_bench(_fake("hang", "hang.py"), [str(pid_file)], work, 3,
                             script_dir=tmp_path)
    assert hung.status == "timed out" and hung.returncode is None
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while proctree.alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proctree.alive(grandchild)
    assert run_all.summarize(hung)[0].failed.startswith("timed out")


def test_main_runs_every_benchmark_and_writes_only_where_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "ok.py").write_text(textwrap.dedent(_OK_SCRIPT))
    (scripts / "fail.py").write_text(_FAIL_SCRIPT)
    monkeypatch.setattr(run_all, "SCRIPT_DIR", scripts)
    monkeypatch.setattr(run_all, "BENCHES", (_fake("broken", "fail.py"), _fake("fine", "ok.py")))
    default_out = tmp_path / "RESULTS.md"
    monkeypatch.setattr(run_all, "DEFAULT_OUT", default_out)

    rc = run_all.main(["--workdir", str(tmp_path / "work")])
    assert rc == 1  # one failed
    assert not default_out.exists()  # a failed run does not replace the published table
    printed = capsys.readouterr().out
    assert "| broken | **failed**: exit status 3" in printed
    assert "| rendezvous | round time, N=4, median | 1.00 s | 2.00 s (c10d) | 0.50 (ours / " \
        "baseline) | - | - |" in printed
    assert "| fake | table |" in printed  # its own table, below

    out = tmp_path / "explicit.md"
    assert run_all.main(["--only", "fine", "--out", str(out)]) == 0
    assert "| rendezvous | round time, N=4" in out.read_text()
    assert "broken" not in out.read_text()
    assert run_all.main(["--only", "fine"]) == 0
    assert default_out.exists()  # full preset, all succeeded: the default file
    default_out.unlink()
    assert run_all.main(["--only", "fine", "--quick"]) == 0
    assert not default_out.exists()  # a quick run never writes it unless told
