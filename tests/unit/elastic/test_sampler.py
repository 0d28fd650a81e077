"""ElasticSampler: exactly-once over any sequence of steps, re-shards and restores."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, TensorDataset

from elastic.errors import ConfigError
from elastic.permutation import epoch_permutation
from elastic.sampler import ElasticSampler


def reference_order(dataset_size: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The documented per-epoch order, computed independently of the sampler."""
    if not shuffle:
        return list(range(dataset_size))
    return list(epoch_permutation(dataset_size, seed, epoch))


@dataclass(frozen=True)
class Step:
    per_rank_per_step: int
    steps: int


@dataclass(frozen=True)
class Reshard:
    world_size: int


@dataclass(frozen=True)
class Restore:
    pass


Op = Step | Reshard | Restore

ops_strategy = st.lists(
    st.one_of(
        st.builds(Step, st.integers(1, 40), st.integers(1, 5)),
        st.builds(Reshard, st.integers(1, 64)),
        st.just(Restore()),
    ),
    max_size=8,
)


class Trainer:
    """Simulates every rank of a data-parallel loop driving the sampler."""

    def __init__(self, dataset_size: int, seed: int, shuffle: bool, drop_last: bool, world: int):
        self.kwargs = {"seed": seed, "shuffle": shuffle, "drop_last": drop_last}
        self.dataset_size = dataset_size
        self.world = world
        self.sampler = ElasticSampler(dataset_size, rank=0, world_size=world, **self.kwargs)
        self.trained: list[int] = []

    def step(self, per_rank: int) -> int:
        """Every rank takes ``per_rank`` indices (fewer at the end); returns how many each took."""
        shards = []
        for rank in range(self.world):
            self.sampler.reshard(rank, self.world)
            shard = list(self.sampler)
            assert len(shard) == len(self.sampler)
            shards.append((shard, self.sampler.padding_count()))
        lengths = {len(shard) for shard, _ in shards}
        assert len(lengths) == 1, "every rank must get the same number of indices"
        taken = min(per_rank, lengths.pop())
        for shard, padding in shards:
            real = len(shard) - padding
            self.trained.extend(shard[: min(taken, real)])
        self.sampler.advance(taken * self.world)
        return taken

    def reshard(self, world: int) -> None:
        self.world = min(world, self.dataset_size)
        self.sampler.reshard(0, self.world)

    def restore(self) -> None:
        saved = json.loads(json.dumps(self.sampler.state_dict()))
        fresh = ElasticSampler(
            self.dataset_size, rank=self.world - 1, world_size=self.world, **self.kwargs
        )
        fresh.load_state_dict(saved)
        assert fresh.state_dict() == self.sampler.state_dict()
        self.sampler = fresh

    def run(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Step):
                for _ in range(op.steps):
                    self.step(op.per_rank_per_step)
            elif isinstance(op, Reshard):
                self.reshard(op.world_size)
            else:
                self.restore()

    def finish_epoch(self) -> None:
        while len(self.sampler) > 0:
            self.step(len(self.sampler))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dataset_size=st.integers(1, 2000),
    world=st.integers(1, 64),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    ops=ops_strategy,
)
def test_without_drop_last_every_index_of_the_epoch_is_trained_exactly_once(
    dataset_size: int, world: int, seed: int, shuffle: bool, ops: list[Op]
) -> None:
    trainer = Trainer(dataset_size, seed, shuffle, False, min(world, dataset_size))
    trainer.run(ops)
    trainer.finish_epoch()

    assert Counter(trainer.trained) == Counter(range(dataset_size))
    assert trainer.sampler.consumed == dataset_size

    trainer.trained = []
    trainer.sampler.set_epoch(1)
    trainer.run(ops[::-1])
    trainer.finish_epoch()
    assert trainer.sampler.epoch == 1
    assert Counter(trainer.trained) == Counter(range(dataset_size))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dataset_size=st.integers(1, 2000),
    world=st.integers(1, 64),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    ops=ops_strategy,
)
def test_with_drop_last_trained_indices_are_the_consumed_prefix_and_fewer_than_world_are_dropped(
    dataset_size: int, world: int, seed: int, shuffle: bool, ops: list[Op]
) -> None:
    trainer = Trainer(dataset_size, seed, shuffle, True, min(world, dataset_size))
    trainer.run(ops)
    trainer.finish_epoch()

    for epoch in (0, 1):
        if epoch == 1:
            trainer.trained = []
            trainer.sampler.set_epoch(1)
            trainer.run(ops[::-1])
            trainer.finish_epoch()
        order = reference_order(dataset_size, seed, epoch, shuffle)
        consumed = trainer.sampler.consumed
        assert trainer.trained and max(Counter(trainer.trained).values()) == 1
        assert sorted(trainer.trained) == sorted(order[:consumed])
        assert dataset_size - consumed < trainer.world


@settings(max_examples=60, deadline=None)
@given(
    dataset_size=st.integers(1, 500),
    world=st.integers(1, 64),
    seed=st.integers(0, 2**31),
    drop_last=st.booleans(),
    ops=ops_strategy,
)
def test_the_same_ops_with_restores_yield_the_same_samples_as_without(
    dataset_size: int, world: int, seed: int, drop_last: bool, ops: list[Op]
) -> None:
    with_restores = Trainer(dataset_size, seed, True, drop_last, min(world, dataset_size))
    with_restores.run(ops)
    with_restores.finish_epoch()
    without = Trainer(dataset_size, seed, True, drop_last, min(world, dataset_size))
    without.run([op for op in ops if not isinstance(op, Restore)])
    without.finish_epoch()

    assert with_restores.trained == without.trained


def test_a_restored_sampler_yields_what_the_original_would_have_on_every_rank() -> None:
    original = ElasticSampler(103, seed=7, rank=0, world_size=4)
    original.advance(40)
    saved = original.state_dict()
    for rank in range(3):
        original.reshard(rank, 3)
        restored = ElasticSampler(103, seed=7, rank=rank, world_size=3)
        restored.load_state_dict(saved)
        assert list(restored) == list(original)


def test_the_first_epoch_order_is_the_seeded_permutation_split_by_rank() -> None:
    order = reference_order(10, 5, 0, True)
    shards = [list(ElasticSampler(10, seed=5, rank=r, world_size=2)) for r in range(2)]
    assert shards == [order[0::2], order[1::2]]


def test_without_shuffle_the_order_is_the_identity() -> None:
    assert list(ElasticSampler(5, shuffle=False, rank=1, world_size=2)) == [1, 3, 0]


def test_padding_repeats_the_first_remaining_indices_and_is_marked_on_the_last_index() -> None:
    samplers = [ElasticSampler(5, shuffle=False, rank=r, world_size=4) for r in range(4)]
    assert [list(s) for s in samplers] == [[0, 4], [1, 0], [2, 1], [3, 2]]
    assert [s.padding_count() for s in samplers] == [0, 1, 1, 1]


def test_drop_last_truncates_the_rest_to_whole_rounds_of_the_world() -> None:
    samplers = [
        ElasticSampler(5, shuffle=False, drop_last=True, rank=r, world_size=2) for r in range(2)
    ]
    assert [list(s) for s in samplers] == [[0, 2], [1, 3]]
    assert [len(s) for s in samplers] == [2, 2]


def test_set_epoch_to_a_new_epoch_restarts_the_cursor_and_changes_the_order() -> None:
    sampler = ElasticSampler(50, seed=3, rank=0, world_size=1)
    sampler.advance(20)
    sampler.set_epoch(0)
    assert sampler.consumed == 20
    sampler.set_epoch(1)
    assert sampler.consumed == 0
    assert list(sampler) == reference_order(50, 3, 1, True)
    assert list(sampler) != reference_order(50, 3, 0, True)


def test_advance_past_what_the_world_still_has_raises_and_keeps_the_cursor() -> None:
    sampler = ElasticSampler(10, rank=0, world_size=4)
    sampler.advance(8)
    with pytest.raises(ValueError, match=r"^advance\(5\) is outside \[0, 4\]"):
        sampler.advance(5)
    assert sampler.consumed == 8
    sampler.advance(4)  # two real samples plus two padding positions finish the epoch
    assert sampler.consumed == 10 and len(sampler) == 0 and list(sampler) == []


def test_advance_while_a_dataloader_prefetches_does_not_change_its_indices() -> None:
    sampler = ElasticSampler(20, seed=1, rank=0, world_size=1)
    iterator = iter(sampler)
    expected = list(sampler)
    sampler.advance(10)
    assert list(iterator) == expected


class IndexDataset(Dataset[int]):
    def __len__(self) -> int:
        return 97

    def __getitem__(self, index: int) -> int:
        return index


def test_a_dataloader_with_two_workers_yields_exactly_the_sampler_indices() -> None:
    sampler = ElasticSampler(97, seed=11, rank=1, world_size=3)
    sampler.advance(30)
    loader = DataLoader(IndexDataset(), batch_size=4, sampler=sampler, num_workers=2)
    seen = [int(i) for batch in loader for i in batch]
    assert seen == list(sampler)


def test_rank_and_world_come_from_the_environment_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sampler = ElasticSampler(30)
    assert (sampler.rank, sampler.world_size) == (2, 3)


def test_a_dataset_smaller_than_the_world_is_a_one_sentence_config_error() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^world size \(8\) must be between 1 and the dataset size \(5\); "
        r"use fewer ranks or a larger dataset\.$",
    ):
        ElasticSampler(5, rank=0, world_size=8)


def test_a_rank_outside_the_world_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^rank \(3\) must be in \[0, 3\)"):
        ElasticSampler(5, rank=3, world_size=3)


@pytest.mark.parametrize(
    ("key", "saved", "mine"),
    [("dataset_size", 100, 101), ("seed", 1, 2)],
)
def test_a_checkpoint_of_another_dataset_or_seed_is_refused_naming_both_values(
    key: str, saved: int, mine: int
) -> None:
    writer_kwargs = {"dataset_size": 100, "seed": 1, key: saved}
    reader_kwargs = {"dataset_size": 100, "seed": 1, key: mine}
    writer = ElasticSampler(
        writer_kwargs["dataset_size"], seed=writer_kwargs["seed"], rank=0, world_size=1
    )
    writer.advance(10)
    reader = ElasticSampler(
        reader_kwargs["dataset_size"], seed=reader_kwargs["seed"], rank=0, world_size=1
    )
    with pytest.raises(
        ConfigError,
        match=rf"^checkpointed sampler {key} \({saved}\) differs from this sampler's {key} "
        rf"\({mine}\); [^.]*\.$",
    ):
        reader.load_state_dict(writer.state_dict())
    assert reader.consumed == 0


def test_a_state_dict_without_the_cursor_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("missing keys (consumed)")):
        ElasticSampler(10, rank=0, world_size=1).load_state_dict(
            {"epoch": 0, "seed": 0, "dataset_size": 10, "shuffle": True}
        )


def test_a_state_dict_of_the_randperm_order_is_refused_in_one_sentence() -> None:
    # What ElasticSampler.state_dict() wrote before the constant-memory order (no "order").
    legacy = {"epoch": 2, "consumed": 30, "seed": 1, "dataset_size": 100, "shuffle": True}
    sampler = ElasticSampler(100, seed=1, rank=0, world_size=1)
    with pytest.raises(
        ConfigError,
        match=r"^checkpointed sampler order \(torch\.randperm\) differs from this sampler's "
        r"order \(feistel-v1\): the checkpoint was written before [^.]*; finish that run with "
        r"the elastic-run version that wrote it or start in a new checkpoint directory\.$",
    ):
        sampler.load_state_dict(legacy)
    assert (sampler.epoch, sampler.consumed) == (0, 0)
    # Without shuffling the order never changed: such a state is resumed.
    sequential = ElasticSampler(100, seed=1, shuffle=False, rank=0, world_size=1)
    sequential.load_state_dict({**legacy, "shuffle": False})
    assert (sequential.epoch, sequential.consumed) == (2, 30)
    assert sequential.state_dict()["order"] == "sequential"


def test_a_state_dict_of_another_order_is_refused() -> None:
    saved = {**ElasticSampler(100, rank=0, world_size=1).state_dict(), "order": "feistel-v0"}
    with pytest.raises(ConfigError, match=r"^checkpointed sampler order \(feistel-v0\) differs "
                       r"from this sampler's order \(feistel-v1\), so its cursor counts"):
        ElasticSampler(100, rank=0, world_size=1).load_state_dict(saved)


def test_a_trillion_samples_give_a_first_batch_at_once_in_constant_memory() -> None:
    from elastic.batching import plan_batches

    size = 10**12  # an int64 randperm of it would need 8 TB
    sampler = ElasticSampler(size, seed=9, rank=5, world_size=7)
    sampler.set_global_batch_size(1000)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 3, "consumed": size - 400})
    batches = sampler.micro_batches(plan_batches(1000, 64, 7))
    first_step = [i for _ in range(3) for i in next(batches)]  # shares of 143: 64, 64, 15
    assert len(first_step) == 143 and len(set(first_step)) == 143
    # The step straddles epochs 3 and 4: this rank's positions j % 7 == 5 of the stream.
    order3, order4 = epoch_permutation(size, 9, 3), epoch_permutation(size, 9, 4)
    expected = [order3[size - 400 + j] if j < 400 else order4[j - 400]
                for j in range(5, 1000, 7)]
    assert first_step == expected
    assert sampler.stream_positions(2) == [(3, order3[size - 400]), (3, order3[size - 399])]


def test_the_managed_loop_refuses_a_checkpoint_of_the_randperm_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch import nn

    from elastic.loop import ElasticLoop

    def run(steps: int) -> None:
        model = nn.Linear(2, 1)
        loop = ElasticLoop(None, model=model,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           data=TensorDataset(torch.randn(20, 2), torch.randn(20, 1)),
                           global_batch_size=4, max_steps=steps, checkpoint=str(tmp_path),
                           install_signal_handler=False)
        for x, y in loop.batches():
            loop.backward(nn.functional.mse_loss(loop.model(x), y))

    # What a checkpoint of the randperm-era sampler holds: its state had no "order".
    current = ElasticSampler.state_dict
    monkeypatch.setattr(ElasticSampler, "state_dict",
                        lambda self: {k: v for k, v in current(self).items() if k != "order"})
    run(2)
    monkeypatch.undo()
    # DCP finds the key missing before the sampler sees the state: still one sentence.
    with pytest.raises(ConfigError, match=r"^the newest checkpoint in \(.*\) does not fit this "
                       r"job's model or state \(.*Missing key in checkpoint state_dict: "
                       r"elastic\.sampler\.order\.\); point the checkpoint URL at a new "
                       r"directory or restore the code that wrote it\.$"):
        run(4)
