"""The import rules between the worker side, the contract and the control plane.

* A worker-side module (``elastic/``, ``checkpointing/``) never imports the control plane
  (``membership``) or the launcher (``launch``): workers learn the world from their agent.
* The control plane reaches the worker package only through the contract
  (``elastic.contract``) and the environment's names (``elastic.env``).
* The contract imports nothing of either side, and :mod:`torch_private` (the private torch
  APIs every side uses) nothing of ours.

Checked twice: over the source (every import statement, also inside functions and
``TYPE_CHECKING`` blocks), and by importing every worker-side module in a fresh interpreter
and looking at ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER_SIDE = ("elastic", "checkpointing")
CONTROL_PLANE = ("membership", "launch")
#: What the control plane may import from the worker package.
CONTRACT = ("elastic.contract", "elastic.env")
#: torch imports the ``torchrun.handlers`` entry point (and so its package) whenever
#: ``torch.distributed.elastic.rendezvous`` is imported, in any process: it is import-light.
PLUGIN_ENTRY = ["membership", "membership.rendezvous"]


def imported_modules(source: str) -> Iterator[str]:
    """Every module an ``import`` statement of ``source`` names (absolute imports)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            # ``from elastic import env`` names the module elastic.env.
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(package: str, source: str) -> list[str]:
    """The imports of a module of ``package`` that break the rules."""
    found = []
    for module in set(imported_modules(source)):
        if package == "elastic.contract":
            if _within(module, ("elastic", *CONTROL_PLANE, "checkpointing")) and not _within(
                    module, ("elastic.contract",)) and module != "elastic":
                found.append(module)
        elif (package in WORKER_SIDE and _within(module, CONTROL_PLANE)) or (package == "membership"
              and _within(module, ("elastic", "checkpointing", "launch"))
              and module != "elastic" and not _within(module, CONTRACT)):
            found.append(module)
    return sorted(found)


def _sources(package: str) -> list[Path]:
    return sorted((REPO / package.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize("package", [*WORKER_SIDE, "membership", "elastic.contract",
                                     "torch_private"])
def test_no_module_breaks_the_import_rules(package: str) -> None:
    files = _sources(package)
    assert files, f"no sources under {package}"
    broken = {}
    for path in files:
        owner = "elastic.contract" if "elastic/contract" in path.as_posix() else package
        found = violations(owner, path.read_text())
        if found:
            broken[str(path.relative_to(REPO))] = found
    assert not broken, f"imports that break the rules (see this module's docstring): {broken}"


@pytest.mark.parametrize(("package", "source", "expected"), [
    ("elastic", "from membership.etcd import EtcdClient\n", ["membership.etcd"]),
    ("checkpointing", "def f():\n    import launch.node_agent\n", ["launch.node_agent"]),
    ("elastic", "import importlib\nimportlib.import_module('membership.job')\n",
     ["membership.job"]),
    ("membership", "from elastic.loop import ElasticLoop\n", ["elastic.loop"]),
    ("membership", "from elastic import env\nfrom elastic.contract.records import X\n", []),
    ("elastic.contract", "from elastic.agent_link import AgentLink\n", ["elastic.agent_link"]),
])
def test_the_checker_flags_what_it_should(package: str, source: str,
                                          expected: list[str]) -> None:
    assert [v for v in violations(package, source) if v in expected or not expected] == \
        expected


def test_importing_the_worker_side_loads_no_control_plane() -> None:
    modules = []
    for package in WORKER_SIDE:
        for path in _sources(package):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            modules.append(name.removesuffix(".__init__"))
    script = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in ('membership', 'launch'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    # The plugin's entry module comes from torch's own import of its rendezvous registry.
    assert loaded in ([], PLUGIN_ENTRY), (
        f"importing the worker side loaded the control plane: {loaded}")


def test_the_plugin_entry_point_is_import_light() -> None:
    script = (
        "import json, sys\n"
        "import membership.rendezvous\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in ('membership', 'launch', 'elastic')\n"
        "                        or m == 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == PLUGIN_ENTRY
