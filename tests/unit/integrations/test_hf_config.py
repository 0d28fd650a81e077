"""ElasticTrainer refuses training arguments that cannot checkpoint an elastic job, each
with one sentence naming the value, and sets the batch arguments from the global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.frameworks import framework

transformers = framework("transformers")

from elastic.integrations.hf import ElasticTrainer  # noqa: E402 - after the framework's check
from elastic_errors import ConfigError  # noqa: E402


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Any:
        return {"loss": nn.functional.mse_loss(self.linear(x), labels)}


@pytest.fixture(autouse=True)
def _alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ELASTIC_ROUND",
                 "ELASTIC_AGENT_SOCKET", "ELASTIC_TELEMETRY_SOCKET", "ELASTIC_EVENTS_DIR"):
        monkeypatch.delenv(name, raising=False)


def _args(tmp: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {"output_dir": str(tmp), "max_steps": 10, "save_steps": 5,
                              "use_cpu": True, "report_to": "none",
                              "per_device_train_batch_size": 3}
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def test_arguments_that_cannot_checkpoint_the_job_are_refused(tmp_path: Path) -> None:
    for overrides, message in (
        ({"save_strategy": "epoch"}, r"save_strategy \(epoch\) must be 'steps'"),
        ({"max_steps": -1}, r"max_steps \(-1\) must be set"),
        ({"save_total_limit": 1}, r"save_total_limit \(1\) would delete"),
    ):
        with pytest.raises(ConfigError, match=message):
            ElasticTrainer(model=_Model(), args=_args(tmp_path, **overrides),
                           global_batch_size=12)


def test_the_batch_arguments_follow_the_global_batch(tmp_path: Path) -> None:
    args = _args(tmp_path)
    trainer = ElasticTrainer(model=_Model(), args=args, global_batch_size=12)
    # One rank: a share of 12 in micro-batches of at most 3 (the per-device batch).
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.ignore_data_skip) == (3, 4, True)
    assert trainer.elastic.micro_batch_sizes == (3, 3, 3, 3)
    with pytest.raises(ConfigError, match=r"global_batch_size \(0\)"):
        ElasticTrainer(model=_Model(), args=_args(tmp_path), global_batch_size=0)
