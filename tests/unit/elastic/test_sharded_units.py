"""Sharded loops without processes: the refusals of bad input, the copies' cadence and
memory check, and the stand-in output of an abandoned sharded forward."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from elastic.loop import ElasticLoop
from elastic.loop.abandoned import AbandonedOutput, abandoned_output
from elastic.sharded import copies as copies_module
from elastic.sharded.copies import ShardCopies, Snapshot
from elastic.sharded.model import ShardedTraining, meta_copy
from elastic_errors import ConfigError


def _parallelize(model: nn.Module, mesh: Any) -> nn.Module:
    return model


def _loop(**overrides: Any) -> ElasticLoop:
    kwargs: dict[str, Any] = dict(
        model=nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        parallelize=_parallelize, sampler=None, max_steps=3, global_batch_size=4,
        install_signal_handler=False)
    kwargs.update(overrides)
    return ElasticLoop(None, **kwargs)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)},
     r"^with parallelize=, optimizer= must be a callable of the parameters \(got SGD\)"),
    ({"scheduler": torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), 2)},
     r"^with parallelize=, scheduler= must be a callable of the optimizer \(got StepLR\)"),
    ({"redundancy": 2}, r"^redundancy \(2\) must be 0 \(storage only\) or 1"),
    ({"micro_batch_size": 1}, r"^micro_batch_size \(1\) with parallelize="),
    ({"replicate": 0}, r"^replicate \(0\) must be at least 1\.$"),
    ({"model": None}, r"^parallelize= needs model= \(with its initial weights\)"),
    ({"snapshot_every": 0}, r"^snapshot_every \(0\) must be at least 1"),
])
def test_bad_sharded_arguments_are_refused_in_one_sentence(overrides: dict[str, Any],
                                                            message: str) -> None:
    if "snapshot_every" in overrides:
        with pytest.raises(ConfigError, match=message):
            ShardCopies(every=overrides["snapshot_every"])
        return
    with pytest.raises(ConfigError, match=message):
        _loop(**overrides)


def test_sharding_arguments_without_parallelize_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^replicate \(2\) and snapshot_every \(None\) "
                                          r"shape a sharded model; pass parallelize="):
        ElasticLoop(None, sampler=None, max_steps=1, global_batch_size=2, replicate=2,
                    install_signal_handler=False)


def test_a_sharded_loop_needs_torch_distributed() -> None:
    loop = _loop()
    with pytest.raises(ConfigError, match=r"^parallelize= needs torch.distributed"):
        loop.restore()


def test_the_skeleton_holds_no_parameter_memory_and_keeps_buffers_and_sharing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(3.0)
    model.add_module("tied", model[0])
    skeleton = meta_copy(model)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    assert skeleton[0].weight is skeleton.tied.weight
    assert torch.equal(skeleton[1].running_mean, torch.full((4,), 3.0))
    assert model[0].weight.device.type == "cpu"  # the original is untouched


def test_a_sharded_training_refuses_to_be_used_before_its_first_world() -> None:
    training = ShardedTraining(nn.Linear(2, 2), parallelize=_parallelize,
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(RuntimeError, match="built when the loop enters its first world"):
        training.require()


class _Group:
    """Stands for a process group where none is used (nothing is sent)."""


def _configured(every: int | None = None) -> ShardCopies:
    copies = ShardCopies(every=every)
    copies.configure(_Group(), holder=1, owner=1, shards=2, index=0,  # type: ignore[arg-type]
                     local_workers=2)
    return copies


def test_copies_refuse_in_one_sentence_when_host_memory_cannot_hold_them(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(copies_module, "available_host_memory", lambda: 1 << 20)
    copies = _configured()
    shard = {"p:w": torch.zeros(1 << 16, dtype=torch.float64)}  # 512 KiB
    with pytest.raises(ConfigError, match=(
            r"^redundancy=1 keeps 4 shard-sized buffers per worker in host memory \(0\.00 GiB "
            r"for each of this node's 2 workers\) but only 0\.00 GiB is available; pass "
            r"redundancy=0 \(storage only\) or give the node more host memory\.$")):
        copies.take(1, shard, {})
    # A later world (the shards grew as the world shrank) goes on without copies.
    copies.configure(_Group(), holder=1, owner=1, shards=1, index=0,  # type: ignore[arg-type]
                     local_workers=2)
    with caplog.at_level(logging.WARNING, logger=copies_module.__name__):
        copies.take(2, shard, {})
    assert not copies.enabled and copies.own == []
    assert "no shard copies in this world" in caplog.text


def test_a_fixed_cadence_refreshes_at_multiples_of_k() -> None:
    copies = _configured(every=3)
    assert [s for s in range(1, 10) if copies.due(s)] == [3, 6, 9]
    assert not ShardCopies(every=3).due(3)  # no holder: nothing to refresh


def test_the_automatic_cadence_spends_at_most_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copies = _configured()
    assert copies.due(1)  # no snapshot of this world yet
    now = [100.0]
    monkeypatch.setattr(copies_module.time, "monotonic", lambda: now[0])
    copies.own = [Snapshot(step=1, shards=2, index=0, tensors={}, small={})]
    copies._last_take = 100.0
    copies.blocking_s, copies.exchange_s = 0.004, 0.006  # 10 ms per refresh
    now[0] = 100.9
    assert not copies.due(5)
    now[0] = 101.0  # 100 x 10 ms since the last: 1 %
    assert copies.due(6)
    copies.own = [Snapshot(step=1, shards=3, index=0, tensors={}, small={})]
    now[0] = 100.1
    assert copies.due(7)  # the world changed: its first refresh is due at once


def test_discarding_drops_the_snapshots_of_an_abandoned_history() -> None:
    copies = _configured()
    copies.own = [Snapshot(step=s, shards=2, index=0, tensors={}, small={}) for s in (3, 6)]
    copies.copies = [Snapshot(step=s, shards=2, index=1, tensors={}, small={}) for s in (3, 6)]
    copies.discard_after(4)
    assert [s.step for s in copies.own] == [3] and [s.step for s in copies.copies] == [3]


def test_an_abandoned_forward_returns_a_stand_in_that_absorbs_the_loss() -> None:
    out = abandoned_output()
    loss = nn.functional.mse_loss(out, torch.randn(4, 1))
    assert isinstance(loss, AbandonedOutput) and torch.isnan(torch.tensor(loss.item()))
    ce = nn.functional.cross_entropy(out, torch.tensor([1, 2]))  # any shapes
    assert isinstance(ce, AbandonedOutput)
    assert isinstance((out * 2 + 1).sum(), AbandonedOutput)
