"""Sharded models (FSDP2, HSDP) that keep training through membership changes in place.

* :mod:`~elastic.sharded.plan`: which rank sends which rows when the state changes world
  (pure; tested with tables).
* :mod:`~elastic.sharded.transfer`: moves those rows point to point over gloo.
* :mod:`~elastic.sharded.model`: the model built on every world (``parallelize``), its
  optimizer and scheduler rebuilt on that world's sharding.
* :mod:`~elastic.sharded.copies`: each shard's copy in a peer's host memory (redundancy).
* :mod:`~elastic.sharded.reshard`: the heal of a new world from survivors' shards and copies.

``ElasticLoop(parallelize=...)`` (:mod:`elastic.loop.sharding`) puts them together; the
contract is in ``docs/sharded.md``.
"""
