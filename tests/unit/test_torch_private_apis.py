"""The private (or undocumented) torch APIs elastic-run still relies on, pinned.

Every one is wrapped in :mod:`torch_private` and used nowhere else; if a torch upgrade renames
one, a test here fails loudly, naming the use and what breaks, instead of a fallback quietly
costing a feature. The list, with the reason for each and whether a public alternative
exists, is in ``docs/rendezvous.md``. gloo's sockets (shut down to free peers blocked on an
abandoned world) are pinned on real gloo groups by ``tests/unit/elastic/test_inplace_sockets.py``
and ``tests/unit/elastic/test_inplace_abort.py``.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

import torch_private

REPO = Path(__file__).resolve().parents[2]


def _in_a_fresh_process(code: str) -> str:
    """Runs ``code`` in a new interpreter (torch's group registry is per process)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_c10d_store_classes_are_the_public_ones() -> None:
    # Imported from torch._C._distributed_c10d only because torch's type stubs do not
    # re-export them.
    for name in ("Store", "TCPStore", "HashStore", "PrefixStore"):
        assert getattr(torch_private, name) is getattr(dist, name), (
            f"torch._C._distributed_c10d.{name} is no longer torch.distributed.{name}: "
            "switch torch_private's import to the public name")


@pytest.mark.parametrize(("name", "use"), [
    ("_abort_process_group", "torch_private.abort_process_group (elastic/inplace/groups.py "
     "abort_groups()): cancelling NCCL work of a dead peer's world (without it, destroy may "
     "wait forever)"),
    ("_set_pg_timeout", "torch_private.set_pg_timeout (elastic/process_group.py "
     "lower_timeouts() and the in-place groups): the training timeout after a generous init "
     "timeout"),
])
def test_private_c10d_functions_exist(name: str, use: str) -> None:
    assert callable(getattr(distributed_c10d, name, None)), (
        f"torch.distributed.distributed_c10d.{name} is gone; {use} now falls back")


def test_set_pg_timeout_and_the_group_name_counter_work_on_a_real_group() -> None:
    out = _in_a_fresh_process("""
        from datetime import timedelta
        import torch.distributed as dist
        import torch_private
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        first = dist.new_group(backend="gloo")
        ok = torch_private.set_pg_timeout(timedelta(seconds=7), first)
        name = first.group_name
        dist.destroy_process_group()
        dist.distributed_c10d._world.group_count = 5  # a build that failed half-way
        torch_private.reset_group_names()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        again = dist.new_group(backend="gloo")
        print(ok, name == again.group_name)
    """)
    assert out == "True True", (
        "torch_private.set_pg_timeout or reset_group_names (distributed_c10d._world."
        "group_count) no longer works: elastic/inplace/groups.py cannot make a failed "
        "build's survivors name the next world's groups alike, or lower their timeout")


def test_process_group_backend_lookup_exists() -> None:
    for name in ("_get_backend", "_device_types"):
        assert hasattr(dist.ProcessGroup, name), (
            f"ProcessGroup.{name} is gone; torch_private.accelerator_backends() finds no NCCL "
            "communicator to abort (elastic/inplace/abort.py)")


def test_nccl_group_start_and_end_are_what_torch_itself_calls() -> None:
    """``Backend._group_start``/``_group_end`` wrap several NCCL aborts (pytorch#119797).

    On a CUDA build the methods must exist on ``ProcessGroupNCCL``; everywhere, torch's own
    ``_abort_process_group`` must still call them by these names."""
    nccl = getattr(distributed_c10d, "ProcessGroupNCCL", None)
    if distributed_c10d.is_nccl_available() and nccl is not None:
        assert hasattr(nccl, "_group_start") and hasattr(nccl, "_group_end")
    called = {node.attr for node in ast.walk(ast.parse(textwrap.dedent(
        inspect.getsource(distributed_c10d._abort_process_group))))
        if isinstance(node, ast.Attribute)}
    assert {"_group_start", "_group_end"} <= called, (
        "torch's _abort_process_group no longer calls Backend._group_start/_group_end; "
        "torch_private.nccl_group() must follow whatever it does now")


class _Backend:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self._name = calls, name

    def name(self) -> str:
        return self._name

    def abort(self) -> None:
        self.calls.append(f"abort {self._name}")

    def _group_start(self) -> None:
        self.calls.append("group_start")

    def _group_end(self) -> None:
        self.calls.append("group_end")


def test_several_aborts_run_inside_one_nccl_group_and_one_needs_none() -> None:
    calls: list[str] = []
    torch_private.abort_backends([_Backend(calls, "a"), _Backend(calls, "b")])
    assert calls == ["group_start", "abort a", "abort b", "group_end"]
    calls.clear()
    torch_private.abort_backends([_Backend(calls, "a")])
    assert calls == ["abort a"]


def test_dcp_fsspec_reader_and_dtensor_spec_exist() -> None:
    from torch.distributed.tensor import DTensor

    assert "path" in inspect.signature(torch_private.FsspecReader.__init__).parameters, (
        "FsspecReader(path, **storage_options) changed; checkpointing/manager.py reads "
        "checkpoints on fsspec URLs with it")
    assert "_spec" in dir(DTensor), (
        "DTensor._spec is gone; torch_private.dtensor_spec() (checkpointing/staging.py) "
        "builds host copies of DTensors from it")


def test_the_dtensor_sharding_caches_can_be_cleared() -> None:
    # elastic/sharded/model.py forget_old_meshes(): a new world's mesh equals an old world's
    # of the same size, and torch's DTensor caches would hand the new world's tensors the old
    # mesh object (this process's old coordinate): wrong checkpoint offsets, dead groups.
    assert torch_private.clear_dtensor_caches() == [], (
        "a DTensor sharding-propagation cache can no longer be cleared; sharded models "
        "re-sharded in place may carry an old world's mesh")


def test_torchrun_argument_parsing_entry_points_exist() -> None:
    from torch.distributed.argparse_util import env
    from torch.distributed.run import config_from_args, get_args_parser

    assert callable(env) and callable(get_args_parser) and callable(config_from_args), (
        "launch/cli.py parses torchrun's flags with torch.distributed.run's own parser")


def _private_torch_uses(path: Path) -> list[str]:
    """Names of torch's private modules or attributes that ``path`` reaches for."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            parts = [*node.module.split("."), *(a.name for a in node.names)]
            found += [p for p in parts if p.startswith("_") and p != "__future__"]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_") \
                and any(t in ast.unparse(node.args[0]) for t in ("torch", "dist", "c10d")):
            found.append(str(node.args[1].value))
    return found


def test_the_scan_finds_private_uses(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from torch._C._distributed_c10d import TCPStore\n"
                      "import torch.distributed as dist\n"
                      "f = getattr(dist.distributed_c10d, '_set_pg_timeout', None)\n")
    assert _private_torch_uses(sample) == ["_C", "_distributed_c10d", "_set_pg_timeout"]


@pytest.mark.parametrize("package", ["elastic", "checkpointing", "launch", "membership"])
def test_no_other_module_reaches_for_a_private_torch_api(package: str) -> None:
    used: dict[str, Any] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        found = _private_torch_uses(path)
        if found:
            used[str(path.relative_to(REPO))] = found
    assert not used, f"private torch APIs outside torch_private: {used}"
