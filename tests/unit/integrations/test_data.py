"""The step stream of the framework integrations: a fixed global batch on any world, each
sample once, and loss factors that make uneven shares give the global batch's mean."""

from __future__ import annotations

from collections import Counter

import pytest

from elastic.batching import plan_batches
from elastic.integrations._data import StepBatches, even_split
from elastic_errors import ConfigError

G, N = 10, 64


def _world(world: int, accumulation: int, at_step: int) -> list[StepBatches]:
    out = []
    for rank in range(world):
        share = plan_batches(G, G, world).share(rank)
        stream = StepBatches(N, global_batch_size=G, rank=rank, world_size=world,
                             micro_batch_sizes=even_split(share, accumulation), seed=3)
        stream.seek(at_step)
        out.append(stream)
    return out


def _steps(streams: list[StepBatches], count: int) -> list[list[int]]:
    """The ids every rank trains in each of the next ``count`` steps."""
    per_rank = [iter(s) for s in streams]
    accumulation = streams[0].accumulation
    steps = []
    for _ in range(count):
        ids = []
        for it in per_rank:
            for _ in range(accumulation):
                ids.extend(next(it))
        steps.append(ids)
    return steps


def test_any_sequence_of_worlds_trains_the_same_samples_as_one_rank() -> None:
    reference = _steps(_world(1, 1, 0), 30)
    trained = (_steps(_world(3, 2, 0), 9) + _steps(_world(2, 3, 9), 12)
               + _steps(_world(5, 1, 21), 9))
    assert [Counter(s) for s in trained] == [Counter(s) for s in reference]
    assert all(len(s) == G for s in trained)
    # 30 steps of 10 samples over 64: epochs 0-3 whole, epoch 4 in part, each sample of an
    # epoch once (steps straddle epochs).
    counts = Counter(i for s in trained for i in s)
    assert sum(counts.values()) == 300 and set(counts.values()) <= {4, 5}


def test_the_loss_factors_make_every_sample_weigh_one_over_the_global_batch() -> None:
    for world, accumulation in ((3, 2), (4, 2), (7, 1), (2, 3)):
        for stream in _world(world, accumulation, 0):
            for j, size in enumerate(stream.micro_batch_sizes):
                # mean loss * factor / accumulation (the framework) / world (DDP's average)
                weight = stream.loss_factor(j) / accumulation / world / size
                assert weight == pytest.approx(1 / G)


def test_seek_equals_advancing_and_a_pass_starts_at_the_cursor() -> None:
    (a,), (b,) = _world(1, 2, 0), _world(1, 2, 0)
    for _ in range(13):
        a.advance()
    b.seek(13)
    assert (a.step, b.step) == (13, 13)
    assert a.sampler.state_dict() == b.sampler.state_dict()
    assert next(iter(a)) == next(iter(b)) == _steps(_world(1, 1, 0), 14)[13][:5]


def test_sizes_that_do_not_make_the_share_are_refused() -> None:
    assert even_split(7, 3) == (3, 2, 2)
    with pytest.raises(ConfigError, match=r"add up to rank 0's share \(4"):
        StepBatches(N, global_batch_size=G, rank=0, world_size=3, micro_batch_sizes=(2, 1))
    with pytest.raises(ConfigError, match="must be positive"):
        StepBatches(N, global_batch_size=G, rank=1, world_size=3, micro_batch_sizes=(3, 0))
    with pytest.raises(ValueError, match="non-negative"):
        _world(1, 1, 0)[0].seek(-1)
