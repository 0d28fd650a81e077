"""The managed loop's data: a map-style dataset through an :class:`ElasticSampler`, or an
:class:`~elastic.stream.ElasticShardedStream` through its own cursor and loader.

Either way the loop sees one cursor (``loop.sampler``: re-sharded on a new world, advanced by
the global batch after each step, checkpointed) and one ``DataLoader`` per world whose items
are this rank's micro-batches, step after step, optionally with the sample ids of each
(``ELASTIC_SAMPLE_AUDIT``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch.utils.data import DataLoader

from elastic.batching import BatchPlan
from elastic.loop.audit import IndexedCollate, IndexedDataset
from elastic.sampler import ElasticSampler
from elastic.stream import ElasticShardedStream
from elastic_errors import ConfigError

__all__ = ["managed_loader", "managed_sampler"]


def managed_sampler(data: Any, sampler: ElasticSampler | None, seed: int) -> ElasticSampler:
    """The cursor of the managed loop's ``data``: the stream's own, or a new sampler over a
    map-style dataset (unless the script passed ``sampler=``).

    Raises:
        ConfigError: If a stream comes with a sampler of its own.
    """
    if isinstance(data, ElasticShardedStream):
        if sampler is not None and sampler is not data.sampler:
            raise ConfigError(
                "an ElasticShardedStream carries its own cursor; leave sampler= out (or pass "
                "stream.sampler)."
            )
        return data.sampler
    if sampler is not None:
        return sampler
    return ElasticSampler(len(data), seed=seed)


def managed_loader(data: Any, plan: BatchPlan, batch_sampler: Callable[[], Iterable[list[int]]],
                   options: Mapping[str, Any], with_ids: bool) -> DataLoader[Any]:
    """A loader of this rank's micro-batches from the cursor (taken when it is iterated).

    Args:
        data: The managed loop's ``data``.
        plan: The batch plan of the current world.
        batch_sampler: Makes the batch sampler of a map-style dataset (``loop.batch_sampler``).
        options: The script's ``loader_options``.
        with_ids: Yield ``(sample ids, batch)`` (the per-sample audit).
    """
    if isinstance(data, ElasticShardedStream):
        return data.loader(plan, with_ids=with_ids, **options)
    options = dict(options)
    if with_ids:  # the indices travel with the samples
        data = IndexedDataset(data)
        options["collate_fn"] = IndexedCollate(options.get("collate_fn"))
    return DataLoader(data, batch_sampler=batch_sampler(), **options)
