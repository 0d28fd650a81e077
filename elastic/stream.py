"""``ElasticShardedStream``: exactly-once streaming over shards, on any world, resumable anywhere.

A corpus too large for a map-style dataset usually lives in shards: files (local or on object
storage, any fsspec URL) of a known number of samples each. The stream gives every epoch one
global order of all samples, the same on every world size, and hands it out like
:class:`~elastic.sampler.ElasticSampler` hands out indices: the state is the global cursor
``(epoch, consumed)``, step ``s`` trains stream positions ``[s * G, (s + 1) * G)``, and rank
``r`` of ``W`` takes the step's positions ``j`` with ``j % W == r``. So a restore or a
membership change (in place or by restart, to any world size) resumes exactly after the last
trained sample, and every sample of an epoch is trained exactly once.

**The order of an epoch** (a bijection from positions to ``(shard, offset)``, computed from the
seed, the epoch and the shard sizes only, in ``O(shards)`` memory):

1. The shards are shuffled (a seeded permutation of the shard list, per epoch), and their
   samples, each shard in file order, laid end to end: the *read sequence*.
2. The read sequence is cut into windows of ``buffer_size`` samples, and each window is
   shuffled on its own (a seeded permutation per window, :mod:`elastic.permutation`).
   Position ``p`` is sample ``w * B + pi_w(p - w * B)`` of the read sequence, ``w = p // B``.

A window spans several shards when ``buffer_size`` exceeds a shard's size: choose it several
shards large for a good mix across shards; samples of a window never leave it. This is the
block shuffle of streaming libraries, made a pure function of the position.

**Reading.** Every reader (a rank's ``DataLoader`` worker, or the rank itself without workers)
knows its positions in advance. It takes one window at a time: the positions it needs there,
sorted by their place in the read sequence, so each shard is read forward only, from the
first sample it needs (:class:`JsonlFormat` seeks through an offset index; other formats
plug in through :class:`ShardFormat`), and stays open until the reader passes its end. A
shard is therefore opened at most once per epoch by each reader, and never read from its
start again after a restore. A reader holds the samples of at most one window's share of
its positions (about ``buffer_size / (W * workers)``).

**Workers.** ``DataLoader`` workers get the rank's micro-batches round-robin (worker ``k`` of
``K`` reads micro-batches ``k, k + K, ...``), which is the order in which ``DataLoader``
returns them, so the rank sees exactly its micro-batches in stream order.

**Use.** With the managed loop, pass the stream as ``data``::

    shards = [Shard(f"s3://bucket/train-{i:05d}.jsonl", 10_000) for i in range(2_000)]
    stream = ElasticShardedStream(shards, seed=7, buffer_size=65_536, transform=tokenize)
    loop = ElasticLoop(ctx, model=model, optimizer=opt, data=stream,
                       global_batch_size=512, micro_batch_size=32, max_steps=100_000,
                       checkpoint="s3://bucket/run", loader_options={"num_workers": 4})

The explicit way passes ``sampler=stream.sampler`` to ``ElasticLoop`` and reads
``stream.loader(loop.plan, num_workers=4)`` (rebuilt when the world changes, like
``loop.batch_sampler()``). With ``ELASTIC_SAMPLE_AUDIT=DIR`` every shard open is logged
there (``{"kind": "open", ...}``) next to the loop's per-sample audit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TextIO

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from elastic.batching import BatchPlan
from elastic.permutation import (
    ORDER,
    ROUNDS,
    FeistelPermutation,
    IdentityPermutation,
    Permutation,
    epoch_permutation,
    round_keys,
)
from elastic.sampler import ElasticSampler, PositionBatch
from elastic_errors import ConfigError

__all__ = [
    "AUDIT_ENV",
    "ElasticShardedStream",
    "JsonlFormat",
    "Shard",
    "ShardFormat",
    "ShardReader",
    "ShardedOrder",
    "write_jsonl_shard",
]

AUDIT_ENV: Final = "ELASTIC_SAMPLE_AUDIT"  # the loop's audit directory (elastic.loop.audit)
STREAM_ORDER: Final = f"shards+windows/{ORDER}"
"""The construction of the stream's order, saved with its cursor."""

_SMALL_WINDOW = 1024  # windows up to this size are shuffled by a table (exactly uniform)
_PLAIN_UNIT = 256  # samples a reader holds at most when iterated sample by sample
_WINDOW_CACHE = 4


@dataclass(frozen=True)
class Shard:
    """One shard: where it is and how many samples it holds.

    Attributes:
        url: Any fsspec URL (``/data/a.jsonl``, ``s3://bucket/a.jsonl``...).
        num_samples: The samples in it (at least 1).
    """

    url: str
    num_samples: int


class ShardReader(Protocol):
    """An open shard, read forward only."""

    def read(self, offsets: Sequence[int]) -> list[Any]:
        """The samples at ``offsets`` (increasing, and above every offset read before)."""

    def close(self) -> None:
        """Releases the shard."""


class ShardFormat(Protocol):
    """How to open a shard (picklable: ``DataLoader`` workers receive it)."""

    def open(self, shard: Shard) -> ShardReader:
        """Opens ``shard`` for forward reading."""


# ---------------------------------------------------------------------------------- jsonl


def _index_url(url: str) -> str:
    return url + ".idx"


def write_jsonl_shard(url: str, samples: Sequence[Any],
                      storage_options: dict[str, Any] | None = None) -> Shard:
    """Writes ``samples`` as a JSON-lines shard with its offset index (``url + ".idx"``).

    The index holds the byte offset of every line and the file's size, as little-endian
    uint64, so that a reader seeks straight to any sample.

    Args:
        url: Where the shard goes (any fsspec URL).
        samples: JSON-serialisable samples, one per line.
        storage_options: fsspec options of the filesystem.

    Returns:
        The shard, with its sample count.

    Raises:
        ConfigError: If ``samples`` is empty.
    """
    import fsspec

    if not samples:
        raise ConfigError(f"a shard needs at least one sample; got none for ({url}).")
    lines = [json.dumps(s, separators=(",", ":")).encode() + b"\n" for s in samples]
    offsets = np.zeros(len(lines) + 1, dtype="<u8")
    offsets[1:] = np.cumsum([len(line) for line in lines])
    with fsspec.open(url, "wb", **(storage_options or {})) as f:
        f.write(b"".join(lines))
    with fsspec.open(_index_url(url), "wb", **(storage_options or {})) as f:
        f.write(offsets.tobytes())
    return Shard(url, len(lines))


@dataclass(frozen=True)
class JsonlFormat:
    """JSON-lines shards, one sample per line (what :func:`write_jsonl_shard` writes).

    With the offset index ``url + ".idx"`` a reader seeks to each line it needs; without one
    it reads forward line by line (still one pass, but through every line).

    Attributes:
        storage_options: fsspec options of the filesystem.
    """

    storage_options: dict[str, Any] = field(default_factory=dict)

    def open(self, shard: Shard) -> ShardReader:
        return _JsonlReader(shard, self.storage_options)


class _JsonlReader:
    def __init__(self, shard: Shard, storage_options: dict[str, Any]) -> None:
        import fsspec

        fs, path = fsspec.core.url_to_fs(shard.url, **storage_options)
        self._shard = shard
        self._index: npt.NDArray[np.uint64] | None
        try:
            self._index = np.frombuffer(fs.cat_file(_index_url(path)), dtype="<u8")
        except FileNotFoundError:
            self._index = None
        if self._index is not None and len(self._index) != shard.num_samples + 1:
            raise ConfigError(
                f"shard ({shard.url}) is declared with {shard.num_samples} samples but its "
                f"index lists {len(self._index) - 1}; pass the shard's real sample count."
            )
        self._file = fs.open(path, "rb")
        self._line = 0  # without an index: the line the file is positioned at

    def read(self, offsets: Sequence[int]) -> list[Any]:
        out = []
        for offset in offsets:
            if self._index is not None:
                start, stop = int(self._index[offset]), int(self._index[offset + 1])
                self._file.seek(start)
                line = self._file.read(stop - start)
            else:
                while self._line < offset:
                    self._file.readline()
                    self._line += 1
                line = self._file.readline()
                self._line += 1
            if not line:
                raise ConfigError(
                    f"shard ({self._shard.url}) ends before sample {offset}; it is declared "
                    f"with {self._shard.num_samples} samples: pass its real sample count."
                )
            out.append(json.loads(line))
        return out

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------- order


class ShardedOrder(Permutation):
    """One epoch's order of the stream (see the module docstring): position -> sample id.

    Sample ids number the samples in the order of the shard list: shard ``i``'s sample
    ``o`` is ``sum(num_samples of shards before i) + o``, whatever the epoch.

    Args:
        counts: Samples per shard, in the order of the shard list.
        seed: The stream's seed.
        epoch: The epoch.
        buffer_size: The window size ``B``.
        shuffle: Shuffle shards and windows (else the read sequence of the listed shards).
    """

    def __init__(self, counts: npt.NDArray[np.int64], *, seed: int, epoch: int,
                 buffer_size: int, shuffle: bool) -> None:
        super().__init__(int(counts.sum()))
        self._seed, self._epoch, self._shuffle = seed, epoch, shuffle
        self.buffer_size = buffer_size
        shards = len(counts)
        if shuffle:
            self.shard_order = epoch_permutation(shards, seed, epoch, "shards").take(
                np.arange(shards, dtype=np.int64))
        else:
            self.shard_order = np.arange(shards, dtype=np.int64)
        #: Where each slot of the read sequence starts (slot ``i`` is shard ``shard_order[i]``).
        self.starts = np.concatenate([[0], np.cumsum(counts[self.shard_order])]).astype(np.int64)
        self._slot_of = np.empty(shards, dtype=np.int64)
        self._slot_of[self.shard_order] = np.arange(shards, dtype=np.int64)
        self._base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._windows: dict[int, Permutation] = {}

    def _window(self, w: int) -> Permutation:
        window = self._windows.get(w)
        if window is None:
            size = min(self.buffer_size, self.size - w * self.buffer_size)
            if not self._shuffle:
                window = IdentityPermutation(size)
            elif size <= _SMALL_WINDOW:
                window = epoch_permutation(size, self._seed, self._epoch, f"window {w}")
            else:  # O(1) per position: a reader maps only its share of each window
                window = FeistelPermutation(
                    size, round_keys(ROUNDS, ORDER, self._seed, self._epoch, f"window {w}"))
            if len(self._windows) >= _WINDOW_CACHE:
                del self._windows[min(self._windows)]
            self._windows[w] = window
        return window

    def read_positions(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Where ``positions`` are in the read sequence (each window shuffled on its own)."""
        positions = np.asarray(positions, dtype=np.int64)
        windows = positions // self.buffer_size
        out = np.empty_like(positions)
        for w in np.unique(windows).tolist():
            mask = windows == w
            start = w * self.buffer_size
            out[mask] = start + self._window(w).take(positions[mask] - start)
        return out

    def locate(self, positions: npt.NDArray[np.int64]) -> tuple[
            npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(read-sequence places, shard indices, offsets in the shard)`` of ``positions``."""
        q = self.read_positions(positions)
        slots = np.searchsorted(self.starts, q, side="right") - 1
        return q, self.shard_order[slots], q - self.starts[slots]

    def sample_ids(self, shards: npt.NDArray[np.int64],
                   offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The sample ids of ``(shard, offset)`` pairs."""
        ids: npt.NDArray[np.int64] = self._base[shards] + offsets
        return ids

    def take(self, positions: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
        _, shards, offsets = self.locate(np.asarray(positions, dtype=np.int64))
        return self.sample_ids(shards, offsets)

    def _index(self, position: int) -> int:
        return int(self.take(np.array([position], dtype=np.int64))[0])

    def position_of(self, index: int) -> int:
        index = self._check(index, "index")
        shard = int(np.searchsorted(self._base, index, side="right") - 1)
        q = int(self.starts[self._slot_of[shard]]) + index - int(self._base[shard])
        w = q // self.buffer_size
        return w * self.buffer_size + self._window(w).position_of(q - w * self.buffer_size)

    def shard_end(self, shard: int) -> int:
        """Where ``shard`` ends in the read sequence."""
        return int(self.starts[self._slot_of[shard] + 1])


# --------------------------------------------------------------------------------- cursor


class _StreamCursor(ElasticSampler):
    """The stream's global cursor: an :class:`ElasticSampler` over all samples whose epoch
    orders are the stream's (it yields sample ids), saved with the shard layout."""

    _STATE_SOURCE = "ElasticShardedStream.sampler.state_dict()"

    def __init__(self, stream: ElasticShardedStream, *, seed: int, shuffle: bool,
                 rank: int | None, world_size: int | None) -> None:
        self._owner = stream
        super().__init__(stream.num_samples, seed=seed, shuffle=shuffle, rank=rank,
                         world_size=world_size)

    def _order_of(self, epoch: int) -> Permutation:
        return self._owner.order(epoch)

    @property
    def order_name(self) -> str:
        return STREAM_ORDER if self._shuffle else "shards/sequential"

    def _identity(self) -> dict[str, Any]:
        return {**super()._identity(), "shards": len(self._owner.shards),
                "layout": self._owner.layout, "buffer_size": self._owner.buffer_size}


# --------------------------------------------------------------------------------- stream


class ElasticShardedStream(IterableDataset[Any]):
    """An iterable dataset over shards with an exactly-once global order (module docstring).

    Args:
        shards: The shards (``Shard`` or ``(url, num_samples)``), in a fixed order: the order
            is part of the stream's identity.
        seed: Seed of the epoch orders (the same on every rank).
        shuffle: Shuffle shards and windows; when false the samples come shard after shard,
            each in file order.
        buffer_size: Samples per shuffle window (see the module docstring).
        format: How shards are read (default :class:`JsonlFormat`).
        transform: Applied to each sample as it is read (in the ``DataLoader`` worker).
        collate_fn: Makes a micro-batch of transformed samples (default ``default_collate``).
        rank: This rank (default: from the process group or ``RANK``, as the sampler).
        world_size: The number of ranks (default: likewise).

    Raises:
        ConfigError: If there are no shards, a shard is empty, or ``buffer_size`` is not
            positive.
    """

    def __init__(self, shards: Sequence[Shard | tuple[str, int]], *, seed: int = 0,
                 shuffle: bool = True, buffer_size: int = 16_384,
                 format: ShardFormat | None = None,
                 transform: Callable[[Any], Any] | None = None,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 rank: int | None = None, world_size: int | None = None) -> None:
        self.shards = tuple(s if isinstance(s, Shard) else Shard(*s) for s in shards)
        if not self.shards:
            raise ConfigError("ElasticShardedStream needs at least one shard; got none.")
        for shard in self.shards:
            if int(shard.num_samples) < 1:
                raise ConfigError(
                    f"shard ({shard.url}) has {shard.num_samples} samples; leave empty shards "
                    "out of the list."
                )
        if buffer_size < 1:
            raise ConfigError(f"buffer_size ({buffer_size}) must be a positive sample count.")
        self.buffer_size = buffer_size
        self.format: ShardFormat = format or JsonlFormat()
        self.transform, self.collate_fn = transform, collate_fn
        self._counts = np.array([int(s.num_samples) for s in self.shards], dtype=np.int64)
        self._seed, self._shuffle = seed, shuffle
        self._orders: dict[int, ShardedOrder] = {}
        #: The global cursor (an ElasticSampler whose indices are sample ids): what a loop
        #: re-shards, advances and checkpoints.
        self.sampler: ElasticSampler = _StreamCursor(self, seed=seed, shuffle=shuffle,
                                                     rank=rank, world_size=world_size)

    @property
    def num_samples(self) -> int:
        """Samples in all shards (one epoch)."""
        return int(self._counts.sum())

    @property
    def layout(self) -> str:
        """A digest of the shard sizes, in order: a cursor belongs to one layout."""
        return hashlib.sha256(self._counts.astype("<i8").tobytes()).hexdigest()[:16]

    def order(self, epoch: int) -> ShardedOrder:
        """The order of ``epoch`` (position -> sample id; :meth:`ShardedOrder.locate`)."""
        order = self._orders.get(epoch)
        if order is None:
            order = ShardedOrder(self._counts, seed=self._seed, epoch=epoch,
                                 buffer_size=self.buffer_size, shuffle=self._shuffle)
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order

    def locate(self, sample_id: int) -> tuple[Shard, int]:
        """The shard and the offset in it of a sample id."""
        bounds = np.cumsum(self._counts)
        shard = int(np.searchsorted(bounds, sample_id, side="right"))
        return self.shards[shard], sample_id - int(bounds[shard] - self._counts[shard])

    def loader(self, plan: BatchPlan, *, with_ids: bool = False,
               **options: Any) -> DataLoader[Any]:
        """A ``DataLoader`` of this rank's micro-batches, step after step, from the cursor.

        Each item is a collated micro-batch (``collate_fn`` of the transformed samples), or
        ``(sample ids, micro-batch)`` with ``with_ids``. The cursor and the world are taken
        when the loader's iterator is made: make a new loader after a re-shard or a restore.

        Args:
            plan: The batch plan of the current world (``loop.plan``).
            with_ids: Yield the sample ids with each micro-batch (for audits).
            **options: ``DataLoader`` options (``num_workers``, ``pin_memory``,
                ``prefetch_factor``...).

        Raises:
            ConfigError: If the cursor is not in stream mode for ``plan``, or an option would
                reorder or replay micro-batches.
        """
        self.sampler.position_batches(plan)  # checks the plan against the cursor now
        for name, bad in (("persistent_workers", True), ("in_order", False)):
            if name in options and options[name] is bad:
                raise ConfigError(
                    f"DataLoader option {name}={bad} would replay or reorder the stream's "
                    "micro-batches; leave it out."
                )
        for name in ("batch_size", "shuffle", "sampler", "batch_sampler", "collate_fn",
                     "drop_last"):
            if name in options:
                raise ConfigError(
                    f"DataLoader option ({name}) is the stream's to decide; pass collate_fn "
                    "to ElasticShardedStream and leave the others out."
                )
        dataset = _MicroBatches(self, plan, with_ids)
        return DataLoader(dataset, batch_size=None, collate_fn=_as_is, **options)

    def __iter__(self) -> Iterator[Any]:
        """This rank's samples (transformed, not collated) from the cursor, in this process:
        the rest of the epoch split as :class:`ElasticSampler` splits it, or, in stream mode,
        the endless stream."""
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ConfigError(
                "iterating an ElasticShardedStream in several DataLoader workers would read "
                "its samples more than once; build the loader with stream.loader(plan)."
            )
        units: Iterator[PositionBatch] = (
            (e[i:i + _PLAIN_UNIT], p[i:i + _PLAIN_UNIT])
            for e, p in self.sampler.positions() for i in range(0, len(p), _PLAIN_UNIT))
        reader = _Reader(self, _OpenLog.from_env(self.sampler))

        def samples() -> Iterator[Any]:
            try:
                for _ids, batch in reader.read(units):
                    yield from batch
            finally:
                reader.close()

        return samples()


def _as_is(item: Any) -> Any:
    return item


class _MicroBatches(IterableDataset[Any]):
    """What ``stream.loader()`` iterates: this rank's micro-batches, split over workers."""

    def __init__(self, stream: ElasticShardedStream, plan: BatchPlan, with_ids: bool) -> None:
        self.stream, self.plan, self.with_ids = stream, plan, with_ids

    def __iter__(self) -> Iterator[Any]:
        # The cursor is read now (in a worker: as pickled when the loader's iterator was made).
        units = self.stream.sampler.position_batches(self.plan)
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            units = itertools.islice(units, info.id, None, info.num_workers)
        reader = _Reader(self.stream, _OpenLog.from_env(self.stream.sampler))
        collate = self.stream.collate_fn or default_collate

        def batches() -> Iterator[Any]:
            try:
                for ids, samples in reader.read(units):
                    batch = collate(samples)
                    yield (ids, batch) if self.with_ids else batch
            finally:
                reader.close()

        return batches()


# --------------------------------------------------------------------------------- reader


class _OpenLog:
    """Where a reader records each shard it opens (``ELASTIC_SAMPLE_AUDIT``), and in memory."""

    def __init__(self, directory: str | None, rank: int, world: int) -> None:
        self.directory, self.rank, self.world = directory, rank, world
        self.opens: list[tuple[int, int]] = []  # (epoch, shard)
        self._file: TextIO | None = None
        info = get_worker_info()
        self.worker = info.id if info is not None else -1
        self.reader = uuid.uuid4().hex[:12]

    @classmethod
    def from_env(cls, cursor: ElasticSampler) -> _OpenLog:
        return cls(os.environ.get(AUDIT_ENV) or None, cursor.rank, cursor.world_size)

    def opened(self, epoch: int, shard: int) -> None:
        self.opens.append((epoch, shard))
        if self.directory is None:
            return
        if self._file is None:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            self._file = open(  # noqa: SIM115 - closed with the reader
                Path(self.directory) / f"pid{os.getpid()}.jsonl", "a")
        self._file.write(json.dumps({
            "kind": "open", "reader": self.reader, "pid": os.getpid(), "worker": self.worker,
            "rank": self.rank, "world": self.world, "epoch": epoch, "shard": shard}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class _Unit:
    """A micro-batch (or a chunk) being read: its positions and the samples found so far."""

    epochs: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    keys: npt.NDArray[np.int64]  # the window of each position: epoch * windows + window
    ids: npt.NDArray[np.int64] = field(init=False)
    samples: list[Any] = field(init=False)
    missing: npt.NDArray[np.bool_] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = np.zeros(len(self.positions), dtype=np.int64)
        self.samples = [None] * len(self.positions)
        self.missing = np.ones(len(self.positions), dtype=bool)


class _Reader:
    """Reads the samples of a sequence of units window by window, each shard forward."""

    def __init__(self, stream: ElasticShardedStream, log: _OpenLog) -> None:
        self._stream, self._log = stream, log
        self._windows = -(-stream.num_samples // stream.buffer_size)  # per epoch
        self._epoch: int | None = None
        self._open: dict[int, tuple[ShardReader, int]] = {}  # shard -> (reader, next offset)

    def read(self, units: Iterator[PositionBatch]) -> Iterator[tuple[list[int], list[Any]]]:
        """``(sample ids, transformed samples)`` of each unit, in order."""
        pending: deque[_Unit] = deque()
        source = iter(units)
        last_key = -1  # the highest window key pulled so far
        exhausted = False

        def pull() -> bool:
            nonlocal last_key, exhausted
            if exhausted:
                return False
            try:
                epochs, positions = next(source)
            except StopIteration:
                exhausted = True
                return False
            unit = _Unit(epochs, positions,
                         epochs * self._windows + positions // self._stream.buffer_size)
            pending.append(unit)
            last_key = max(last_key, int(unit.keys.max(initial=-1)))
            return True

        transform = self._stream.transform
        while pending or pull():
            unit = pending[0]
            while unit.missing.any():
                key = int(unit.keys[unit.missing].min())
                # Every position of the window is needed before it is read, so that each
                # shard is read forward: pull until the units go past the window.
                while last_key <= key and pull():
                    pass
                self._load(key, pending)
            pending.popleft()
            samples = unit.samples if transform is None else [transform(s) for s in
                                                              unit.samples]
            yield unit.ids.tolist(), samples

    def _load(self, key: int, pending: deque[_Unit]) -> None:
        """Reads every missing sample of window ``key`` that the pending units need."""
        epoch, window = divmod(key, self._windows)
        where: list[tuple[_Unit, npt.NDArray[np.intp]]] = []
        for unit in pending:
            slots = np.flatnonzero(unit.missing & (unit.keys == key))
            if slots.size:
                where.append((unit, slots))
        positions = np.concatenate([u.positions[s] for u, s in where])
        order = self._stream.order(epoch)
        q, shards, offsets = order.locate(positions)
        if epoch != self._epoch:
            self.close_shards()
            self._epoch = epoch
        samples: list[Any] = [None] * len(q)
        by_place = np.argsort(q, kind="stable")
        runs = np.flatnonzero(np.diff(shards[by_place])) + 1
        for run in np.split(by_place, runs):
            shard = int(shards[run[0]])
            wanted = offsets[run].tolist()
            for i, sample in zip(run.tolist(), self._read(epoch, shard, wanted), strict=True):
                samples[i] = sample
        ids = order.sample_ids(shards, offsets)
        at = 0
        for unit, slots in where:
            for j, slot in enumerate(slots.tolist()):
                unit.samples[slot] = samples[at + j]
            unit.ids[slots] = ids[at:at + len(slots)]
            unit.missing[slots] = False
            at += len(slots)
        # Shards the read sequence has passed are done for this epoch.
        window_end = min((window + 1) * self._stream.buffer_size, self._stream.num_samples)
        for shard in [s for s in self._open if order.shard_end(s) <= window_end]:
            self._open.pop(shard)[0].close()

    def _read(self, epoch: int, shard: int, offsets: list[int]) -> list[Any]:
        entry = self._open.get(shard)
        if entry is not None and offsets[0] < entry[1]:
            # Only padding (per-epoch mode) goes back: reopen rather than seek backwards.
            entry[0].close()
            del self._open[shard]
            entry = None
        if entry is None:
            self._log.opened(epoch, shard)
            entry = (self._stream.format.open(self._stream.shards[shard]), 0)
        handle = entry[0]
        samples = handle.read(offsets)
        self._open[shard] = (handle, offsets[-1] + 1)
        return samples

    def close_shards(self) -> None:
        for handle, _ in self._open.values():
            handle.close()
        self._open.clear()

    def close(self) -> None:
        self.close_shards()
        self._log.close()
