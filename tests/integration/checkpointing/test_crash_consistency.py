from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from checkpointing import CheckpointManager

_KILLS = 20
_MAX_STEPS = 200  # stop condition is 20 kills; under load more saves finish before the kill


def _state(step: int) -> dict[str, torch.Tensor]:
    # Several tensors so a mix of two steps would be visible; a few MiB so a save takes a while.
    return {f"t{i}": torch.full((256 * 1024,), float(step)) for i in range(6)}


def _child_save(root: str, step: int) -> None:
    with CheckpointManager(root, keep_last=2) as mgr:
        mgr.save(step, _state(step)).committed.result(60)


# A fork server forks savers from a clean single-threaded process: forking the test process
# itself after torch ran its thread pools can deadlock the child, and spawn would re-import
# torch for every kill point.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "checkpointing.manager"])


def _save_in_child(root: Path, step: int) -> BaseProcess:
    proc = _CTX.Process(target=_child_save, args=(str(root), step), daemon=True)
    proc.start()
    return proc


def test_killing_the_saver_at_random_points_never_leaves_a_mixed_or_bad_latest(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("CKPT_CRASH_SEED", random.randrange(2**32)))
    print(f"crash-consistency seed={seed}")
    rng = random.Random(seed)
    # Measure full saves (the first also starts the fork server), so kill points spread over a
    # whole save.
    full = float("inf")
    for _ in range(3):
        t0 = time.monotonic()
        proc = _save_in_child(tmp_path, 0)
        proc.join(60)
        assert proc.exitcode == 0
        full = min(full, time.monotonic() - t0)
    committed = 0
    kills = 0
    advanced = 0
    step = 0
    while kills < _KILLS and step < _MAX_STEPS:
        step += 1
        proc = _save_in_child(tmp_path, step)
        time.sleep(rng.uniform(0.0, full * 1.5))
        if proc.exitcode is None:
            proc.kill()
            kills += 1
        proc.join(60)
        out = {f"t{i}": torch.empty(256 * 1024) for i in range(6)}
        with CheckpointManager(str(tmp_path), keep_last=2) as mgr:
            info = mgr.load(out)
        assert info is not None, f"seed={seed} step={step}: no loadable checkpoint"
        assert info.step in (committed, step), f"seed={seed}: got {info.step}"
        for name, t in out.items():
            assert torch.equal(t, torch.full_like(t, float(info.step))), (seed, step, name)
        if proc.exitcode == 0:
            assert info.step == step
        advanced += info.step == step
        committed = info.step
    print(f"crash-consistency: {kills} kills, {advanced} of {step} saves committed")
    assert kills >= _KILLS
