"""The private (or undocumented) torch APIs elastic-run still relies on, pinned.

Each is reached through ``getattr`` with a fallback, or imported, at the place named in its
message; if a torch upgrade renames one, this test fails loudly, naming the use and what
breaks, instead of the fallback quietly costing a feature. The list, with the reason for
each and whether a public alternative exists, is in ``docs/rendezvous.md``.
"""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d


def test_the_c10d_store_classes_are_the_public_ones() -> None:
    # elastic/store.py, elastic/inplace/{groups,controller}.py and launch/stores.py import them
    # from torch._C._distributed_c10d only because torch's type stubs do not re-export them.
    import torch._C._distributed_c10d as c10d

    for name in ("Store", "TCPStore", "HashStore", "PrefixStore"):
        assert getattr(c10d, name) is getattr(dist, name), (
            f"torch._C._distributed_c10d.{name} is no longer torch.distributed.{name}: "
            "switch the imports to the public name")


@pytest.mark.parametrize(("name", "use"), [
    ("_abort_process_group", "elastic/inplace/groups.py abort_groups(): cancelling NCCL work "
     "of a dead peer's world (without it, destroy may wait forever)"),
    ("_set_pg_timeout", "elastic/process_group.py lower_timeouts() and the in-place "
     "controller: the training timeout after a generous init timeout"),
])
def test_private_c10d_functions_exist(name: str, use: str) -> None:
    assert callable(getattr(distributed_c10d, name, None)), (
        f"torch.distributed.distributed_c10d.{name} is gone; {use} now falls back")


def test_the_group_name_counter_exists() -> None:
    world = getattr(distributed_c10d, "_world", None)
    assert world is not None and isinstance(getattr(world, "group_count", None), int), (
        "torch.distributed.distributed_c10d._world.group_count is gone; "
        "elastic/inplace/groups.py _reset_group_names() can no longer make a failed build's "
        "survivors name the next world's groups alike")


def test_process_group_backend_lookup_exists() -> None:
    for name in ("_get_backend", "_device_types"):
        assert hasattr(dist.ProcessGroup, name), (
            f"ProcessGroup.{name} is gone; elastic/inplace/abort.py accelerator_backends() "
            "finds no NCCL communicator to abort")


def test_dcp_fsspec_reader_and_dtensor_spec_exist() -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.tensor import DTensor

    assert "path" in inspect.signature(FsspecReader.__init__).parameters, (
        "FsspecReader(path, **storage_options) changed; checkpointing/manager.py reads "
        "checkpoints on fsspec URLs with it")
    assert "_spec" in dir(DTensor), (
        "DTensor._spec is gone; checkpointing/staging.py builds host copies of DTensors "
        "from it")


def test_torchrun_argument_parsing_entry_points_exist() -> None:
    from torch.distributed.argparse_util import env
    from torch.distributed.run import config_from_args, get_args_parser

    assert callable(env) and callable(get_args_parser) and callable(config_from_args), (
        "launch/cli.py parses torchrun's flags with torch.distributed.run's own parser")


def test_the_dtensor_sharding_caches_can_be_cleared() -> None:
    # elastic/sharded/model.py forget_old_meshes(): a new world's mesh equals an old world's
    # of the same size, and torch's DTensor caches would hand the new world's tensors the old
    # mesh object (this process's old coordinate): wrong checkpoint offsets, dead groups.
    import torch
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        assert callable(getattr(getattr(propagator, name), "cache_clear", None)), (
            f"DTensor's sharding propagator has no {name}.cache_clear(); sharded models "
            "re-sharded in place may carry an old world's mesh")
    assert callable(getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)), (
        "torch._C._clear_DTensor_sharding_propagator_cache is gone; sharded models re-sharded "
        "in place may carry an old world's mesh")
