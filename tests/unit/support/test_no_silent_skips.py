"""The CI rule of ``tests/support/no_silent_skips.py``, shown on real pytest runs in subprocesses:
under ``CI=true`` a skip (other than a ``gpu`` test's) fails the run and is named; without CI the
same run passes; pytest-xdist's controller applies the rule to its workers' reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_TESTS = {
    "conftest.py": "from tests.support.no_silent_skips import pytest_configure  # noqa: F401\n",
    "pytest.ini": "[pytest]\nmarkers =\n    gpu: needs a CUDA device\n",
    "test_a.py": (
        "import pytest\n\n"
        "def test_passes():\n    assert True\n\n"
        "def test_skips_at_run_time():\n    pytest.skip('etcd binary not found')\n\n"
        "@pytest.mark.skipif(True, reason='a mark that skips')\n"
        "def test_skipped_by_a_mark():\n    pass\n\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.skipif(True, reason='no CUDA here')\n"
        "def test_gpu_may_skip():\n    pass\n\n"
        "@pytest.mark.xfail(reason='known', strict=True)\n"
        "def test_xfail_is_not_a_skip():\n    assert False\n"
    ),
    "test_b.py": "import pytest\n\npytest.importorskip('no_such_module_for_this_test')\n",
    "test_c.py": "def test_passes_too():\n    assert True\n",
}
FORBIDDEN = {
    "test_a.py::test_skips_at_run_time": "etcd binary not found",
    "test_a.py::test_skipped_by_a_mark": "a mark that skips",
    "test_b.py (whole module)": "could not import 'no_such_module_for_this_test': "
                                "No module named 'no_such_module_for_this_test'",
}


def _run(tmp_path: Path, *args: str, ci: str | None) -> subprocess.CompletedProcess[str]:
    for name, text in _TESTS.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items()
           if k != "CI" and not k.startswith(("PYTEST_", "ELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    # Only the plugins the run needs (xdist where asked for): loading every installed one
    # costs a second of CPU per run.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize("xdist", [[], ["-p", "xdist.plugin", "-n", "2", "--dist", "loadfile"]],
                         ids=["one-process", "xdist"])
def test_under_ci_a_skip_fails_the_run_and_is_named(tmp_path: Path, xdist: list[str]) -> None:
    result = _run(tmp_path, *xdist, ci="true")
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, out
    named = [line for line in out.splitlines() if line.startswith("SKIPPED IN CI ")]
    # Each forbidden skip named once, with its reason; the gpu test and the xfail not at all.
    assert sorted(named) == sorted(f"SKIPPED IN CI {test}: {reason}"
                                   for test, reason in FORBIDDEN.items()), out
    assert "3 skip(s): only tests marked 'gpu' may skip in CI" in out


def test_without_ci_the_same_run_passes(tmp_path: Path) -> None:
    result = _run(tmp_path, "-p", "xdist.plugin", "-n", "2", "--dist", "loadfile", ci=None)
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.OK, out
    assert "SKIPPED IN CI" not in out
    assert "2 passed, 4 skipped, 1 xfailed" in out


def test_under_ci_a_run_whose_only_skip_is_a_gpu_test_passes(tmp_path: Path) -> None:
    result = _run(tmp_path, "test_a.py", "test_c.py", "-k", "passes or gpu or xfail", ci="true")
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.OK, out
    assert "1 skipped" in out and "SKIPPED IN CI" not in out
