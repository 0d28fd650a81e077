"""The one place where a test meets a machine without etcd.

A missing etcd binary skips the test with the reason, unless ``ELASTIC_REQUIRE_ETCD=1`` (set by
CI) makes it a failure, so a missing install can never pass quietly. Every fixture and helper
that starts etcd goes through :func:`etcd_required`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from elastic import env
from launch.etcd_server import EtcdBinaryNotFoundError, find_etcd_binary


@contextmanager
def etcd_required() -> Iterator[None]:
    """Turns an :class:`EtcdBinaryNotFoundError` raised in the block into a skip, or into a
    failure under ``ELASTIC_REQUIRE_ETCD=1``."""
    try:
        yield
    except EtcdBinaryNotFoundError as exc:
        if os.environ.get(env.REQUIRE_ETCD) == "1":
            pytest.fail(f"{exc} ({env.REQUIRE_ETCD}=1 makes this a failure)")
        pytest.skip(str(exc))


def etcd_binary() -> str:
    """The etcd binary the tests run (``$ELASTIC_ETCD_BINARY`` or ``etcd`` on PATH), or a
    skip or failure as :func:`etcd_required` says."""
    with etcd_required():
        return find_etcd_binary()
    raise AssertionError("unreachable: etcd_required skips or fails")  # for type checkers
