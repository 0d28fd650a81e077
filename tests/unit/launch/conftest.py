"""Keeps what an in-process agent exports for its workers inside the test that ran it."""

from __future__ import annotations

import pytest

from elastic import env

# NodeAgent._start_workers writes these into os.environ (torch copies the agent's environment
# into every worker). Left behind, ELASTIC_MODE=restart silently put later integration tests
# of the same pytest session into restart mode.
_AGENT_EXPORTS = (
    env.MODE, env.ROUND, env.RUN_ID, env.AGENT_PID, env.ETCD_ENDPOINTS, env.INPLACE_MARKER,
    env.KEY_PREFIX, env.INPLACE_TTL, env.INPLACE_BUILD_TIMEOUT, "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


@pytest.fixture(autouse=True)
def _agent_exports_stay_in_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    # delenv records each key's value before the test, and monkeypatch puts it back after,
    # whatever the agent wrote in between.
    for key in _AGENT_EXPORTS:
        monkeypatch.delenv(key, raising=False)
