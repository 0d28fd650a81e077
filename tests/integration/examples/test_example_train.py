"""The example job's elastic maths, with real worker processes (torchrun's standalone c10d).

Training 40 steps on two workers and then resuming on one must give the same weights as 60
steps on one worker throughout: the global batch is fixed and every step consumes the same
samples whatever the world size. (The same script under ``elastic-run`` is exercised by the
launcher tests.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpointing import CheckpointManager, ModelOptimizerState

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train.py"

pytestmark = pytest.mark.slow


def _torchrun(nproc: int, steps: int, ckpt_dir: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(EXAMPLE), "--steps", str(steps),
        "--checkpoint-dir", str(ckpt_dir), "--dtype", "float64", "--checkpoint-every", "40",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"done: {steps} steps" in result.stdout


def _weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    # The example checkpoints through CheckpointManager (DCP); read the model back the same way.
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    state = ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    info = CheckpointManager(str(ckpt_dir), async_mode="disabled").load({"train": state})
    assert info is not None and info.step == 60
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resuming_on_a_smaller_world_matches_an_undisturbed_run(tmp_path: Path) -> None:
    elastic_dir, steady_dir = tmp_path / "elastic", tmp_path / "steady"
    _torchrun(2, 40, elastic_dir)
    _torchrun(1, 60, elastic_dir)
    _torchrun(1, 60, steady_dir)

    elastic, steady = _weights(elastic_dir), _weights(steady_dir)
    assert elastic.keys() == steady.keys()
    worst = max((elastic[k] - steady[k]).abs().max().item() for k in steady)
    assert worst < 1e-10, f"weights differ by {worst}"
