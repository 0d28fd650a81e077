"""Errors raised by the checkpoint manager.

Every message is one sentence that names the offending value in parentheses and says what to
do next.
"""

from __future__ import annotations

from elastic_errors import ElasticError


class CheckpointError(ElasticError):
    """Base class of every checkpointing failure."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested checkpoint (or storage location) does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's commit record or one of its files failed verification."""


class CheckpointCommitError(CheckpointError):
    """A save could not be persisted or committed."""


class CheckpointFormatError(CheckpointError):
    """A commit record has a format version this code cannot read."""
