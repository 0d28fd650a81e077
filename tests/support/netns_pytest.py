"""Pytest fixtures for clusters of network namespaces (``tests/support/netns.py``).

Tests that use them are marked ``netns`` and ``slow``. Where the machine cannot run namespaces
(not root, no ``ip`` or ``nft``, namespaces not permitted) they skip with the reason, unless
``ELASTIC_REQUIRE_NETNS=1`` (set by CI) turns the skip into a failure, so a missing capability
can never pass quietly; a missing etcd is treated the same way under ``ELASTIC_REQUIRE_ETCD``.

``tests/conftest.py`` imports the fixtures, so every test can ask for them::

    pytestmark = [pytest.mark.netns, pytest.mark.slow]

    def test_silent_node(netns_cluster_factory):
        cluster = netns_cluster_factory(nodes=3, etcd_members=1)
        ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Final

import pytest

from tests.support.etcd_required import etcd_required
from tests.support.netns import NetnsCluster, netns_unavailable

#: Set to 1 (CI does) to fail instead of skipping where namespaces cannot run.
REQUIRE_NETNS: Final = "ELASTIC_REQUIRE_NETNS"


def require_netns() -> None:
    """Skips the calling test (or fails it under ``ELASTIC_REQUIRE_NETNS=1``) if namespaces
    cannot run here."""
    reason = netns_unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_NETNS) == "1":
        pytest.fail(f"{reason} ({REQUIRE_NETNS}=1 makes this a failure)")
    pytest.skip(reason)


def new_cluster(**kwargs: Any) -> NetnsCluster:
    """A :class:`NetnsCluster` (not started yet); skips or fails like ``etcd_server`` when
    etcd members are asked for and no etcd is installed."""
    with etcd_required():
        return NetnsCluster(**kwargs)
    raise AssertionError("unreachable: etcd_required skips or fails")


@pytest.fixture
def netns_cluster_factory() -> Iterator[Callable[..., NetnsCluster]]:
    """Makes started :class:`NetnsCluster` s (same arguments); each is closed after the test
    and checked with ``assert_clean``."""
    require_netns()
    clusters: list[NetnsCluster] = []

    def make(**kwargs: Any) -> NetnsCluster:
        cluster = new_cluster(**kwargs)
        clusters.append(cluster)
        return cluster.start()

    yield make
    errors = []
    for cluster in clusters:
        try:
            cluster.close()
        except Exception as exc:  # close the others first
            errors.append(exc)
    for cluster in clusters:
        cluster.assert_clean()
    if errors:
        raise errors[0]


@pytest.fixture
def netns_cluster(netns_cluster_factory: Callable[..., NetnsCluster]) -> NetnsCluster:
    """A started cluster of two nodes and one etcd member, removed after the test."""
    return netns_cluster_factory(nodes=2, etcd_members=1)
