"""Fails loudly when torch changes a hook NodeAgent overrides or a field it relies on.

NodeAgent overrides protected methods of torch's SimpleElasticAgent/LocalElasticAgent and reads
``_remaining_restarts``, ``_store``, ``_worker_group``, ``_exit_barrier_timeout`` and
``_in_exit_barrier``. If this test fails after a torch upgrade, re-read ``_invoke_run`` in
``torch/distributed/elastic/agent/server/api.py`` before changing the expectations.
"""

from __future__ import annotations

import inspect

from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from launch.agent import NodeAgent


def _params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_overridden_hooks_keep_their_signatures() -> None:
    assert _params(SimpleElasticAgent._rendezvous) == ["self", "worker_group"]
    assert _params(LocalElasticAgent._start_workers) == ["self", "worker_group"]
    assert _params(LocalElasticAgent._monitor_workers) == ["self", "worker_group"]
    assert _params(SimpleElasticAgent._restart_workers) == ["self", "worker_group"]
    assert _params(SimpleElasticAgent._exit_barrier) == ["self"]
    init = inspect.signature(LocalElasticAgent.__init__).parameters
    for name in ("spec", "logs_specs", "start_method", "exit_barrier_timeout",
                 "log_line_prefix_template", "shutdown_timeout"):
        assert name in init, name


def test_invoke_run_still_charges_failures_and_restarts_on_waiting_nodes() -> None:
    # NodeAgent's accounting assumes exactly this control flow in torch's monitor loop.
    src = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert "self._remaining_restarts -= 1" in src
    assert "self._restart_workers(self._worker_group)" in src
    assert "rdzv_handler.num_nodes_waiting()" in src
    assert "self._exit_barrier()" in src
    assert "self._worker_group.state = state" in src


def test_agent_fields_we_read_exist() -> None:
    class _Handler(DynamicRendezvousHandler):  # never used: only construction matters
        def __init__(self) -> None:
            pass

        def get_run_id(self) -> str:
            return "r"

    spec = WorkerSpec(role="w", local_world_size=1, rdzv_handler=_Handler(), entrypoint="true")
    agent = NodeAgent(spec, DefaultLogsSpecs())
    for field in ("_remaining_restarts", "_store", "_worker_group", "_exit_barrier_timeout",
                  "_in_exit_barrier"):
        assert hasattr(agent, field), field


def test_dynamic_rendezvous_keeps_its_round_where_membership_view_reads_it() -> None:
    src = inspect.getsource(DynamicRendezvousHandler._wrap_store)
    assert "self._state_holder.state.round" in src
