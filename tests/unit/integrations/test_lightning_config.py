"""ElasticLightning refuses settings that would break the global batch, the data order or
the resume, each with one sentence naming the value; a half-written checkpoint is never the
one to resume from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.support.frameworks import framework

lightning = framework("lightning")

from elastic.integrations.lightning import (  # noqa: E402 - after the framework's check
    ElasticLightning,
    FixedBatchDDPStrategy,
)
from elastic_errors import ConfigError  # noqa: E402


@pytest.fixture(autouse=True)
def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ELASTIC_ROUND",
                 "ELASTIC_AGENT_SOCKET", "ELASTIC_TELEMETRY_SOCKET", "ELASTIC_EVENTS_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_the_trainer_arguments_carry_the_job_and_refuse_contrary_ones(tmp_path: Path) -> None:
    elastic = ElasticLightning(str(tmp_path), global_batch_size=8, accumulate_grad_batches=2)
    kwargs = elastic.trainer_kwargs(max_steps=5, callbacks=[], logger=False)
    assert isinstance(kwargs["strategy"], FixedBatchDDPStrategy)
    assert (kwargs["devices"], kwargs["num_nodes"], kwargs["accumulate_grad_batches"],
            kwargs["use_distributed_sampler"], kwargs["enable_checkpointing"]) == \
        (1, 1, 2, False, False)
    assert kwargs["callbacks"] == [elastic.callback] and kwargs["max_steps"] == 5
    with pytest.raises(ConfigError, match=r"Trainer argument strategy \('ddp'\) is decided"):
        elastic.trainer_kwargs(strategy="ddp")
    with pytest.raises(ConfigError, match=r"use_distributed_sampler \(True\)"):
        elastic.trainer_kwargs(use_distributed_sampler=True)


def test_the_loader_arguments_the_global_batch_decides_are_refused(tmp_path: Path) -> None:
    elastic = ElasticLightning(str(tmp_path), global_batch_size=8)
    data = TensorDataset(torch.zeros(20, 2))
    with pytest.raises(ConfigError, match=r"arguments \(batch_size, shuffle\) are decided"):
        elastic.dataloader(data, batch_size=4, shuffle=True)
    loader = elastic.dataloader(data)
    assert loader.batch_sampler is elastic.stream and next(iter(loader))[0].shape == (8, 2)


def test_bad_values_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint_every \(0\) must be a positive"):
        ElasticLightning(str(tmp_path), global_batch_size=8, checkpoint_every=0)
    with pytest.raises(ConfigError, match=r"accelerator \('tpu'\)"):
        ElasticLightning(str(tmp_path), global_batch_size=8, accelerator="tpu")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"global batch \(6\) on 4 ranks leaves shares of 1"):
        ElasticLightning(str(tmp_path), global_batch_size=6, accumulate_grad_batches=2)


def test_resume_takes_the_newest_committed_checkpoint_only(tmp_path: Path) -> None:
    elastic = ElasticLightning(str(tmp_path), global_batch_size=8)
    assert elastic.resume_path() is None
    for step in (5, 10):
        (tmp_path / f"step-{step:09d}.ckpt").write_bytes(b"c" * 64)
    elastic.commits.commit(f"step-{5:09d}.ckpt", 5, {})
    assert elastic.resume_path() == str(tmp_path / "step-000000005.ckpt")


def test_pruning_keeps_the_newest_committed_and_drops_cut_off_ones(tmp_path: Path) -> None:
    elastic = ElasticLightning(str(tmp_path), global_batch_size=8, keep_last=2)
    for step in (5, 10, 12, 15, 20):
        (tmp_path / f"step-{step:09d}.ckpt").write_bytes(b"c" * 64)
    for step in (5, 10, 15):
        elastic.commits.commit(f"step-{step:09d}.ckpt", step, {})
    (tmp_path / "notes.txt").write_text("the user's")
    elastic._prune()  # what a save does after its commit
    # 10 and 15 kept; 5 beyond keep_last; 12 never committed and older than the newest;
    # 20 is newer (being written, or cut off: the next save's prune decides).
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "notes.txt", "step-000000010.ckpt", "step-000000015.ckpt", "step-000000020.ckpt"]
    assert [c.step for c in elastic.commits.committed()] == [10, 15]
