"""ElasticShardedStream: one global order of (shard, offset), read exactly once on any world.

Real jsonl shards on the local disk, read through fsspec. A counting format wraps the real
one to see every shard open and every offset read.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elastic.batching import plan_batches
from elastic.loop import ElasticLoop
from elastic.sampler import ElasticSampler
from elastic.stream import (
    ElasticShardedStream,
    JsonlFormat,
    Shard,
    ShardedOrder,
    ShardReader,
    write_jsonl_shard,
)
from elastic_errors import ConfigError

SIZES = (7, 13, 5, 20, 1, 9, 11)  # 66 samples, uneven shards


def make_shards(root: Path, sizes: tuple[int, ...] = SIZES, index: bool = True) -> list[Shard]:
    shards, base = [], 0
    for i, size in enumerate(sizes):
        url = str(root / f"shard-{i:03d}.jsonl")
        # Each sample says which sample id it is: the reader must deliver exactly that one.
        shards.append(write_jsonl_shard(url, [{"id": base + o, "x": [float(base + o), 1.0]}
                                              for o in range(size)]))
        if not index:
            Path(url + ".idx").unlink()
        base += size
    return shards


@dataclass
class Counting:
    """JsonlFormat that records each open and every offset read (in this process)."""

    inner: JsonlFormat = field(default_factory=JsonlFormat)
    opens: list[str] = field(default_factory=list)
    reads: list[tuple[str, int]] = field(default_factory=list)

    def open(self, shard: Shard) -> ShardReader:
        self.opens.append(shard.url)
        reader = self.inner.open(shard)
        log = self.reads

        class Recording:
            def read(self, offsets: Any) -> list[Any]:
                log.extend((shard.url, o) for o in offsets)
                return reader.read(offsets)

            def close(self) -> None:
                reader.close()

        return Recording()


def stream_of(shards: list[Shard], rank: int, world: int, batch: int, **kwargs: Any,
              ) -> ElasticShardedStream:
    stream = ElasticShardedStream(shards, rank=rank, world_size=world, **kwargs)
    stream.sampler.set_global_batch_size(batch)
    return stream


def step_ids(streams: list[ElasticShardedStream], batch: int, micro: int, steps: int,
             workers: int = 0) -> list[list[int]]:
    """Every rank reads ``steps`` steps with ids; returns each step's ids (all ranks) and
    checks each delivered sample is the one its id names."""
    world = len(streams)
    plan = plan_batches(batch, micro, world)
    per_rank = []
    for rank, stream in enumerate(streams):
        loader = stream.loader(plan, with_ids=True, num_workers=workers)
        it = iter(loader)
        steps_ids = []
        for _ in range(steps):
            ids: list[int] = []
            for size in plan.micro_batch_sizes(rank):
                got, batch_ = next(it)
                assert len(got) == size
                assert batch_["id"].tolist() == got
                ids.extend(got)
            steps_ids.append(ids)
        per_rank.append(steps_ids)
    for stream in streams:
        stream.sampler.advance(batch * steps)
    return [sorted(i for rank in per_rank for i in rank[s]) for s in range(steps)]


def expected(order_of: Any, start: int, count: int, length: int) -> list[int]:
    out = []
    for position in range(start, start + count):
        epoch, p = divmod(position, length)
        out.append(order_of(epoch)[p])
    return sorted(out)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 99),
       epoch=st.integers(0, 5), buffer=st.integers(1, 70), shuffle=st.booleans())
def test_the_order_is_a_bijection_onto_shard_offsets_kept_within_windows(
    sizes: list[int], seed: int, epoch: int, buffer: int, shuffle: bool
) -> None:
    counts = np.array(sizes, dtype=np.int64)
    order = ShardedOrder(counts, seed=seed, epoch=epoch, buffer_size=buffer, shuffle=shuffle)
    n = int(counts.sum())
    positions = np.arange(n)
    ids = order.take(positions)
    assert sorted(ids.tolist()) == list(range(n))
    assert [order.position_of(i) for i in ids.tolist()] == list(range(n))
    q, shards, offsets = order.locate(positions)
    assert np.array_equal(q // buffer, positions // buffer)  # nothing leaves its window
    assert all(0 <= o < sizes[s] for s, o in zip(shards.tolist(), offsets.tolist(), strict=True))
    if not shuffle:
        assert ids.tolist() == list(range(n))


def test_ranks_read_disjoint_shares_of_each_step_and_the_epoch_once(tmp_path: Path) -> None:
    shards = make_shards(tmp_path)
    streams = [stream_of(shards, r, 3, 12, seed=4, buffer_size=16) for r in range(3)]
    trained = step_ids(streams, 12, 3, 11)  # 132 samples: two epochs of 66
    order = streams[0].order
    for step, ids in enumerate(trained):
        assert ids == expected(order, step * 12, 12, 66)
    # Step by step the ids are the next 12 positions of the epoch orders: so each epoch's
    # samples once (the orders are bijections), and each epoch has its own order.
    assert Counter(i for ids in trained for i in ids) == Counter(list(range(66)) * 2)
    assert list(order(0)) != list(order(1))


@pytest.mark.parametrize("index", [True, False])
def test_each_reader_opens_each_shard_at_most_once_per_epoch_and_reads_only_its_samples(
    tmp_path: Path, index: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = make_shards(tmp_path, index=index)
    monkeypatch.setenv("ELASTIC_SAMPLE_AUDIT", str(tmp_path / "audit"))
    counting = Counting()
    stream = stream_of(shards, 1, 2, 6, seed=2, buffer_size=30, format=counting)
    loader = stream.loader(plan_batches(6, 2, 2))
    it = iter(loader)
    got = [next(it) for _ in range(2 * 22)]  # 22 steps of 3 (2 + 1): two epochs of 66
    assert sum(len(b["id"]) for b in got) == 66
    opens = [json.loads(line) for line in (tmp_path / "audit").glob("pid*.jsonl").__next__()
             .read_text().splitlines()]
    assert len(opens) == len(counting.opens)
    for epoch in (0, 1):
        # This rank's positions of the epoch: stream offsets j with j % 6 % 2 == 1.
        mine = np.array([j for j in range(66) if j % 6 % 2 == 1])
        needed = set(stream.order(epoch).locate(mine)[1].tolist())
        opened = [o["shard"] for o in opens if o["epoch"] == epoch]
        assert sorted(opened) == sorted(needed)  # each shard it needs, once
    read = Counter(counting.reads)
    assert max(read.values()) <= 2  # once per epoch
    assert sum(read.values()) == 66  # nothing but this rank's samples


def test_a_restore_on_another_world_resumes_exactly_without_reading_a_shard_from_its_start(
    tmp_path: Path,
) -> None:
    shards = make_shards(tmp_path)
    before = [stream_of(shards, r, 2, 12, seed=9, buffer_size=20) for r in range(2)]
    first = step_ids(before, 12, 4, 2)
    state = json.loads(json.dumps(before[0].sampler.state_dict()))
    counting = [Counting() for _ in range(5)]
    after = []
    for r in range(5):  # a restore on 5 ranks, 12 not a multiple of 5
        stream = ElasticShardedStream(shards, seed=9, buffer_size=20, rank=r, world_size=5,
                                      format=counting[r])
        stream.sampler.load_state_dict(state)
        stream.sampler.set_global_batch_size(12)
        after.append(stream)
    rest = step_ids(after, 12, 4, 3)
    trained = [i for ids in first + rest for i in ids]
    assert len(trained) == 60 and len(set(trained)) == 60
    assert sorted(trained) == expected(before[0].order, 0, 60, 66)
    # After the restore each rank reads only what it trains: nothing of the first 24
    # positions again, no shard re-read from its start.
    reread = {i for c in counting for url, o in c.reads
              for i in [int(Path(url).stem.split("-")[1])]}
    assert reread  # (the shards touched)
    reads = [(url, o) for c in counting for url, o in c.reads]
    assert len(reads) == 36 and len(set(reads)) == 36
    ids_read = {shards_base(shards, url) + o for url, o in reads}
    assert ids_read == set(i for ids in rest for i in ids)


def shards_base(shards: list[Shard], url: str) -> int:
    base = 0
    for shard in shards:
        if shard.url == url:
            return base
        base += shard.num_samples
    raise AssertionError(url)


def test_dataloader_workers_read_disjoint_micro_batches_in_order(tmp_path: Path) -> None:
    shards = make_shards(tmp_path)
    audit = tmp_path / "audit"
    plan = plan_batches(10, 2, 3)  # shares 4, 3, 3: uneven micro-batches
    stream = stream_of(shards, 0, 3, 10, seed=5, buffer_size=25)
    single = list(itertools.islice(iter(stream.loader(plan, with_ids=True)), 30))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ELASTIC_SAMPLE_AUDIT", str(audit))
        workers = list(itertools.islice(iter(stream.loader(plan, with_ids=True,
                                                           num_workers=2)), 30))
    assert [ids for ids, _ in workers] == [ids for ids, _ in single]
    opens = [json.loads(line) for f in audit.glob("pid*.jsonl")
             for line in f.read_text().splitlines()]
    assert {o["worker"] for o in opens} == {0, 1}
    per_reader = Counter((o["reader"], o["epoch"], o["shard"]) for o in opens)
    assert max(per_reader.values()) == 1


def test_iterating_the_stream_yields_this_ranks_share_of_the_epoch(tmp_path: Path) -> None:
    shards = make_shards(tmp_path)
    seen: list[int] = []
    for rank in range(4):  # 66 over 4 ranks: 17 each, two of them end with padding
        stream = ElasticShardedStream(shards, seed=1, buffer_size=10, rank=rank, world_size=4)
        samples = list(stream)
        assert len(samples) == len(stream.sampler) == 17
        real = samples[: len(samples) - stream.sampler.padding_count()]
        seen.extend(s["id"] for s in real)
    assert sorted(seen) == list(range(66))


def test_a_cursor_of_another_layout_or_of_a_sampler_is_refused(tmp_path: Path) -> None:
    shards = make_shards(tmp_path)
    stream = ElasticShardedStream(shards, rank=0, world_size=1)
    other = ElasticShardedStream([*shards[:-1], Shard(shards[-1].url, 12)], rank=0,
                                 world_size=1)
    with pytest.raises(ConfigError, match=r"^checkpointed sampler dataset_size \(66\) differs"):
        other.sampler.load_state_dict(stream.sampler.state_dict())
    swapped = ElasticShardedStream([shards[1], shards[0], *shards[2:]], rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"^checkpointed sampler layout \([0-9a-f]+\) differs"):
        swapped.sampler.load_state_dict(stream.sampler.state_dict())
    sampler = ElasticSampler(66, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"^checkpointed sampler order \(feistel-v1\) differs "
                       r"from this sampler's order \(shards\+windows/feistel-v1\)"):
        stream.sampler.load_state_dict(sampler.state_dict())


def test_bad_input_is_a_one_sentence_config_error(tmp_path: Path) -> None:
    shards = make_shards(tmp_path)
    with pytest.raises(ConfigError, match=r"^ElasticShardedStream needs at least one shard"):
        ElasticShardedStream([])
    with pytest.raises(ConfigError, match=r"^buffer_size \(0\) must be a positive"):
        ElasticShardedStream(shards, buffer_size=0, rank=0, world_size=1)
    stream = stream_of(shards, 0, 1, 4)
    with pytest.raises(ConfigError, match=r"^DataLoader option \(batch_size\) is the stream's"):
        stream.loader(plan_batches(4, 2, 1), batch_size=2)
    with pytest.raises(ConfigError, match=r"persistent_workers=True would replay"):
        stream.loader(plan_batches(4, 2, 1), num_workers=1, persistent_workers=True)
    wrong = ElasticShardedStream([Shard(shards[0].url, 8)], rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"declared with 8 samples but its index lists 7"):
        next(iter(wrong))


# ----------------------------------------------------------------------- the managed loop


def to_tensors(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(sample["x"], dtype=torch.float64)
    return x, x.sum().reshape(1) * 0.5


def train(root: Path, shards: list[Shard], max_steps: int) -> tuple[nn.Module, ElasticLoop]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stream = ElasticShardedStream(shards, seed=3, buffer_size=16, transform=to_tensors)
    loop = ElasticLoop(None, model=model, optimizer=optimizer, data=stream,
                       global_batch_size=8, micro_batch_size=4, max_steps=max_steps,
                       checkpoint=str(root), checkpoint_interval=3,
                       install_signal_handler=False)
    for x, y in loop.batches():
        loop.backward(nn.functional.mse_loss(loop.model(x), y / 100))
    return model, loop


def test_the_managed_loop_resumes_a_stream_to_the_weights_of_an_undisturbed_run(
    tmp_path: Path,
) -> None:
    shards = make_shards(tmp_path / "data")
    steady, _ = train(tmp_path / "steady", shards, 12)  # 96 samples: into the second epoch
    train(tmp_path / "job", shards, 5)  # saves at 3 and 5
    resumed, loop = train(tmp_path / "job", shards, 12)
    assert loop.resumed_from == 5 and loop.step == 12
    for a, b in zip(steady.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_stream_with_a_sampler_of_its_own_is_refused(tmp_path: Path) -> None:
    stream = ElasticShardedStream(make_shards(tmp_path), rank=0, world_size=1)
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError, match=r"^an ElasticShardedStream carries its own cursor"):
        ElasticLoop(None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                    data=stream, sampler=ElasticSampler(66, rank=0, world_size=1),
                    global_batch_size=4, max_steps=1, install_signal_handler=False)
