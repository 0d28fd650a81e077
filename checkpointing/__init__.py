"""Asynchronous, atomic, sharded checkpoints on any fsspec storage."""
