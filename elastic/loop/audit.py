"""An opt-in per-sample audit of the managed loop: which samples each rank trained, per step.

Set ``ELASTIC_SAMPLE_AUDIT=DIR`` and every worker appends JSON lines to
``DIR/pid<PID>.jsonl``:

* ``{"kind": "gen", "gen", "rank", "world", "pid", "step", "storage_loads", "received",
  "source"}`` when it starts training in a new world (after the heal or restore);
* ``{"kind": "batch", "gen", "step", "rank", "ids"}`` for each micro-batch, before its
  backward pass (so a step some rank completed has every rank's ids logged);
* ``{"kind": "done", "gen", "step", "rank", "world", "t"}`` after the optimizer step;
* ``{"kind": "open", "reader", "pid", "worker", "rank", "world", "epoch", "shard"}`` whenever a
  reader of an :class:`~elastic.stream.ElasticShardedStream` (a loader worker, or the rank)
  opens a shard, in that process's own file.

The ids are the dataset indices the loader actually delivered with each batch (the dataset
is wrapped to carry them through the loader, worker processes included), so the audit proves
exactly-once training of a real run, not of the sampler's arithmetic. It costs a few list
copies per micro-batch; leave it off in production.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

from torch.utils.data import Dataset
from torch.utils.data import default_collate as _default_collate

__all__ = ["AUDIT_ENV", "IndexedCollate", "IndexedDataset", "SampleAudit"]

AUDIT_ENV: Final = "ELASTIC_SAMPLE_AUDIT"


class IndexedDataset(Dataset[tuple[int, Any]]):
    """A map-style dataset whose items carry their index: ``(index, sample)``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.inner[index]


class IndexedCollate:
    """Collates ``(index, sample)`` items into ``(indices, the user's collated batch)``.

    A class rather than a closure so that it pickles for ``spawn`` loader workers.
    """

    def __init__(self, inner: Callable[[list[Any]], Any] | None) -> None:
        self.inner = inner or _default_collate

    def __call__(self, items: Sequence[tuple[int, Any]]) -> tuple[list[int], Any]:
        return [int(i) for i, _ in items], self.inner([s for _, s in items])


class SampleAudit:
    """Appends the audit records of one worker (see the module docstring).

    Args:
        directory: Where the worker's ``pid<PID>.jsonl`` goes.
    """

    def __init__(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(Path(directory) / f"pid{os.getpid()}.jsonl", "a")  # noqa: SIM115
        self._generation: int | None = None

    @classmethod
    def from_env(cls) -> SampleAudit | None:
        """The audit ``ELASTIC_SAMPLE_AUDIT`` asks for, or ``None``."""
        directory = os.environ.get(AUDIT_ENV, "")
        return cls(directory) if directory else None

    def _write(self, **record: Any) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def world(self, *, generation: int, rank: int, world: int, step: int, storage_loads: int,
              received: bool, source: int) -> None:
        """Records the start of training in a world (once per generation)."""
        if generation == self._generation:
            return
        self._generation = generation
        self._write(kind="gen", gen=generation, rank=rank, world=world, pid=os.getpid(),
                    step=step, storage_loads=storage_loads, received=received, source=source)

    def batch(self, *, generation: int, step: int, rank: int, ids: list[int]) -> None:
        """Records a micro-batch about to be backpropagated."""
        self._write(kind="batch", gen=generation, step=step, rank=rank, ids=ids)

    def done(self, *, generation: int, step: int, rank: int, world: int) -> None:
        """Records a completed optimizer step."""
        self._write(kind="done", gen=generation, step=step, rank=rank, world=world,
                    t=time.time())

    def close(self) -> None:
        """Closes the file."""
        self._file.close()
