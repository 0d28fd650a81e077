"""The chaos suite's shared environment: one 3-member etcd cluster and one S3 server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.chaos.injector import ChaosEnv, JobShape, chaos_env
from tests.support.etcd_required import etcd_binary


@pytest.fixture(scope="session")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosEnv]:
    """A started :class:`ChaosEnv` with the undisturbed reference run already trained.

    Skips without an etcd binary, unless ``ELASTIC_REQUIRE_ETCD=1`` (CI) makes that a failure.
    """
    etcd_binary()
    with chaos_env(tmp_path_factory.mktemp("chaos")) as env:
        env.reference(JobShape())
        yield env
