"""ElasticSampler's stream mode (fixed global batch): exactly-once across re-shards/restores."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from elastic.permutation import epoch_permutation
from elastic.sampler import ElasticSampler
from elastic_errors import ConfigError


def reference_order(dataset_size: int, seed: int, epoch: int) -> list[int]:
    return list(epoch_permutation(dataset_size, seed, epoch))


def run_steps(
    samplers: list[ElasticSampler], global_batch: int, steps: int
) -> list[list[int]]:
    """Every rank takes its share of ``steps`` global batches; returns each step's ids in
    stream order."""
    world = len(samplers)
    iterators = [iter(s) for s in samplers]
    base, extra = divmod(global_batch, world)
    result = []
    for _ in range(steps):
        shares = [[next(it) for _ in range(base + (rank < extra))]
                  for rank, it in enumerate(iterators)]
        # The step's position j belongs to rank j % world, as its (j // world)-th index.
        ids = [shares[j % world][j // world] for j in range(global_batch)]
        for sampler in samplers:
            sampler.advance(global_batch)
        result.append(ids)
    return result


def world_of(state: dict[str, object], size: int, world: int, batch: int, drop: bool,
             seed: int) -> list[ElasticSampler]:
    samplers = []
    for rank in range(world):
        sampler = ElasticSampler(size, seed=seed, drop_last=drop, rank=rank, world_size=world)
        sampler.load_state_dict(state)
        sampler.set_global_batch_size(batch)
        samplers.append(sampler)
    return samplers


@settings(max_examples=80, deadline=None)
@given(
    size=st.integers(1, 300),
    batch=st.sampled_from([1, 2, 3, 6, 12, 24, 60, 64, 120, 128, 192]),
    data=st.data(),
    drop=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_sequence_of_world_sizes_and_restores_trains_each_sample_once_per_epoch(
    size: int, batch: int, data: st.DataObject, drop: bool, seed: int
) -> None:
    # Any world size up to the global batch (and the dataset), divisor or not.
    worlds = list(range(1, min(64, size, batch) + 1))
    segments = data.draw(
        st.lists(st.tuples(st.sampled_from(worlds), st.integers(0, 4)), min_size=1, max_size=6)
    )
    if drop and batch > size:
        with pytest.raises(ConfigError, match=r"larger than the dataset"):
            ElasticSampler(size, drop_last=True, rank=0, world_size=1).set_global_batch_size(batch)
        return
    state = ElasticSampler(size, seed=seed, drop_last=drop, rank=0, world_size=1).state_dict()
    trained: list[int] = []
    for world, steps in segments:
        samplers = world_of(state, size, world, batch, drop, seed)  # a restore on a new world
        for ids in run_steps(samplers, batch, steps):
            trained.extend(ids)
        state = samplers[0].state_dict()
        assert all(s.state_dict() == state for s in samplers)  # rank-agnostic cursor
    used = size - size % batch if drop else size
    stream = [i for e in range(len(trained) // max(used, 1) + 1)
              for i in reference_order(size, seed, e)[:used]]
    # Step by step the ids are exactly the next global batch of the epoch stream ...
    assert trained == stream[: len(trained)]
    # ... so each epoch's samples appear once, and with drop_last only its last
    # ``size % batch`` positions are never trained.
    for epoch in range(len(trained) // max(used, 1)):
        chunk = trained[epoch * used : (epoch + 1) * used]
        assert Counter(chunk) == Counter(reference_order(size, seed, epoch)[:used])


def test_a_step_may_straddle_two_epochs_without_drop_last() -> None:
    sampler = ElasticSampler(10, seed=1, rank=0, world_size=1)
    sampler.set_global_batch_size(4)
    steps = run_steps([sampler], 4, 3)
    assert steps[2] == reference_order(10, 1, 0)[8:] + reference_order(10, 1, 1)[:2]
    assert (sampler.epoch, sampler.consumed) == (1, 2)


def test_with_drop_last_the_tail_shorter_than_a_global_batch_is_skipped() -> None:
    sampler = ElasticSampler(10, seed=1, drop_last=True, rank=0, world_size=1)
    sampler.set_global_batch_size(4)
    steps = run_steps([sampler], 4, 3)
    assert steps[2] == reference_order(10, 1, 1)[:4]
    assert (sampler.epoch, sampler.consumed) == (1, 4)


def test_stream_positions_name_the_epoch_of_each_sample() -> None:
    sampler = ElasticSampler(5, seed=2, rank=0, world_size=1)
    sampler.set_global_batch_size(3)
    sampler.advance(3)
    assert sampler.stream_positions(4) == [
        (0, reference_order(5, 2, 0)[3]), (0, reference_order(5, 2, 0)[4]),
        (1, reference_order(5, 2, 1)[0]), (1, reference_order(5, 2, 1)[1]),
    ]


def test_a_dataloader_with_workers_reads_the_endless_stream_in_micro_batches() -> None:
    sampler = ElasticSampler(7, seed=4, rank=1, world_size=2)
    sampler.set_global_batch_size(4)
    loader = DataLoader(list(range(7)), batch_size=2, sampler=sampler, num_workers=2)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]  # crosses into epoch 1
    stream = reference_order(7, 4, 0) + reference_order(7, 4, 1)
    assert [i for batch in got for i in batch] == stream[1::2][:6]


def test_micro_batches_cut_each_step_by_the_plan_on_an_uneven_world() -> None:
    from elastic.batching import plan_batches

    plan = plan_batches(7, 2, 3)  # shares 3, 2, 2; two micro-batches each
    seen: list[int] = []
    for rank in range(3):
        sampler = ElasticSampler(20, seed=5, rank=rank, world_size=3)
        sampler.set_global_batch_size(7)
        batches = sampler.micro_batches(plan)
        first_step = [next(batches), next(batches)]
        assert [len(b) for b in first_step] == list(plan.micro_batch_sizes(rank))
        seen.extend(i for b in first_step for i in b)
    assert sorted(seen) == sorted(reference_order(20, 5, 0)[:7])


def test_micro_batches_refuse_a_plan_for_another_world() -> None:
    from elastic.batching import plan_batches

    sampler = ElasticSampler(10, rank=0, world_size=3)
    sampler.set_global_batch_size(6)
    with pytest.raises(ConfigError, match=r"^the plan is for world size \(2\) but the sampler "
                       r"is sharded for \(3\); reshard\(\) it first\.$"):
        next(sampler.micro_batches(plan_batches(6, 2, 2)))
