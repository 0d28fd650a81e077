"""A local filesystem (``failread://``) that refuses every read once a checkpoint is committed.

A worker that registers it (:func:`register`) and checkpoints to ``failread:///some/dir``
writes checkpoints normally; once any ``step-*/COMMIT.json`` exists under the directory named
by ``ELASTIC_TEST_FAIL_READS_UNDER``, opening a file there for reading raises
``PermissionError``. A job that still finishes has recovered from every fault without reading
storage (listing stays allowed: committing a save lists its files).
"""

from __future__ import annotations

import glob
import os
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "failread"
ROOT_ENV = "ELASTIC_TEST_FAIL_READS_UNDER"


class FailingReadsFileSystem(LocalFileSystem):
    """See the module docstring."""

    protocol = (PROTOCOL,)

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)
        super().__init__(**kwargs)

    @staticmethod
    def refusing(path: str) -> bool:
        """Whether reads of ``path`` are refused now."""
        root = os.environ.get(ROOT_ENV, "")
        return bool(root) and os.path.abspath(path).startswith(os.path.abspath(root)) and bool(
            glob.glob(os.path.join(root, "step-*", "COMMIT.json")))

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode and "+" not in mode and self.refusing(self._strip_protocol(path)):
            raise PermissionError(f"test storage refuses to read ({path}) after the first "
                                  "committed save")
        return super()._open(path, mode, *args, **kwargs)


def register() -> None:
    """Makes ``failread://`` URLs open :class:`FailingReadsFileSystem`."""
    fsspec.register_implementation(PROTOCOL, FailingReadsFileSystem, clobber=True)
