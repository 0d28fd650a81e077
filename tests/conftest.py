"""Fixtures shared by every test: a real etcd server on loopback, per-test key prefixes, and
clusters of network namespaces (``netns_cluster``, ``netns_cluster_factory``: see
``tests/support/netns_pytest.py``); and the CI rule that no test may skip except on GPUs
(``tests/support/no_silent_skips.py``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.support.etcd_required import etcd_required
from tests.support.netns_pytest import netns_cluster, netns_cluster_factory  # noqa: F401

# Under CI=true a skipped test (other than a GPU test) fails the run: see the module.
from tests.support.no_silent_skips import pytest_configure  # noqa: F401

# The contract mixins' asserts live outside test modules: have pytest explain them too.
pytest.register_assert_rewrite("tests.contracts")

# Hypothesis fails an example that takes over 200 ms by default: a wall-clock assert that a
# loaded 2-core CI machine breaks (an example that took 2.6 s once, 44 ms when replayed).
# Speed belongs in benchmarks/, so no example has a deadline.
settings.register_profile("elastic-run", deadline=None)
settings.load_profile("elastic-run")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[object]:
    """A real etcd (``$ELASTIC_ETCD_BINARY`` or ``etcd`` on PATH) for the whole session.

    Skips when no binary is installed, unless ``ELASTIC_REQUIRE_ETCD=1`` (set by CI), which
    turns the skip into a failure so a missing install can never pass quietly.
    """
    from launch.etcd_server import EmbeddedEtcd

    with etcd_required():
        server = EmbeddedEtcd()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix no other test uses, so tests share one etcd without wiping it."""
    return f"/elastic-test/{uuid.uuid4().hex[:12]}"
