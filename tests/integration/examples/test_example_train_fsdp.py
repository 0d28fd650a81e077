"""The FSDP2 example job across world sizes by restart (torchrun's standalone c10d): 6 steps
on two workers, then resumed on three from the DCP checkpoint (re-sharded 2 -> 3 shards, the
restart path), give the weights of 10 steps on one worker. (In place, under ``elastic-run``,
the same loop is exercised by ``tests/integration/test_sharded_*_inplace.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_fsdp.py"

pytestmark = pytest.mark.slow


def _torchrun(nproc: int, steps: int, ckpt_dir: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(EXAMPLE), "--steps", str(steps), "--width", "16",
           "--blocks", "2", "--global-batch", "12", "--micro-batch", "4",
           "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "6", "--dtype", "float64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"done: {steps} steps" in result.stdout


def _weights(ckpt_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = max(p.parent for p in ckpt_dir.glob("step-*/COMMIT.json"))
    dcp_to_torch_save(str(newest), str(tmp / "full.pt"))
    return dict(torch.load(tmp / "full.pt", weights_only=False)["train"]["model"])


@pytest.mark.timeout(600)
def test_resuming_on_a_larger_world_matches_an_undisturbed_run(tmp_path: Path) -> None:
    elastic_dir, steady_dir = tmp_path / "elastic", tmp_path / "steady"
    _torchrun(2, 6, elastic_dir)
    _torchrun(3, 10, elastic_dir)
    _torchrun(1, 10, steady_dir)
    elastic, steady = _weights(elastic_dir, tmp_path), _weights(steady_dir, tmp_path)
    assert elastic.keys() == steady.keys()
    worst = max((elastic[k] - steady[k]).abs().max().item() for k in steady)
    assert worst < 1e-9, f"weights differ by {worst}"
