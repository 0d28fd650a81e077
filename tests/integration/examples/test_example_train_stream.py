"""The streaming example restored on another world (restart mode): exactly the undisturbed run.

25 steps in one process (no loader workers), then the job is restarted from its checkpoint on
3 fresh worker processes (torchrun's standalone c10d, a loader worker each; the global batch of
10 splits 4, 3, 3) to step 45:
the weights must equal 45 undisturbed steps in one process. The stream's cursor is what the
checkpoint carries; nothing else connects the two runs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "train_stream.py"

pytestmark = pytest.mark.slow


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_stream_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(root: Path, ckpt: Path, steps: int) -> list[str]:
    return ["--dtype", "float64", "--data-dir", str(root / "data"), "--shards", "5",
            "--samples-per-shard", "30", "--buffer-size", "40", "--global-batch", "10",
            "--micro-batch", "4", "--checkpoint-every", "25", "--steps", str(steps),
            "--checkpoint-dir", str(ckpt)]


def _in_process(root: Path, ckpt: Path, steps: int) -> nn.Module:
    example = _example()
    args = example.parse_args([*_args(root, ckpt, steps), "--loader-workers", "0"])
    model, loop = example.build(args, None)
    example.train(args, loop, leader=False)
    assert loop.finished
    module: nn.Module = model
    return module


def test_a_restart_on_three_workers_resumes_the_stream_exactly(tmp_path: Path) -> None:
    _in_process(tmp_path, tmp_path / "job", 25)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           str(EXAMPLE), *_args(tmp_path, tmp_path / "job", 45), "--loader-workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "done: 45 steps" in result.stdout
    # It resumed at step 25 (a fresh start would print steps 10 and 20 too).
    assert "step 30/45" in result.stdout and "step 20/45" not in result.stdout

    steady = _in_process(tmp_path, tmp_path / "steady", 45).state_dict()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    state = ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    info = CheckpointManager(str(tmp_path / "job"), async_mode="disabled").load(
        {"train": state})
    assert info is not None and info.step == 45
    worst = max((model.state_dict()[k] - steady[k]).abs().max().item() for k in steady)
    assert worst < 1e-10, f"weights differ by {worst}"
