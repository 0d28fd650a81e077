"""The chaos suite's shared environment: one 3-member etcd cluster and one S3 server."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from elastic import env as elastic_env
from tests.chaos.injector import ChaosEnv, JobShape, chaos_env


@pytest.fixture(scope="session")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosEnv]:
    """A started :class:`ChaosEnv` with the undisturbed reference run already trained.

    Skips without an etcd binary, unless ``ELASTIC_REQUIRE_ETCD=1`` (CI) makes that a failure.
    """
    from launch.etcd_server import EtcdBinaryNotFoundError, find_etcd_binary

    try:
        find_etcd_binary()
    except EtcdBinaryNotFoundError as exc:
        if os.environ.get(elastic_env.REQUIRE_ETCD) == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    with chaos_env(tmp_path_factory.mktemp("chaos")) as env:
        env.reference(JobShape())
        yield env
