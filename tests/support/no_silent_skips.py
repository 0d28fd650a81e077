"""Pytest hooks that fail a CI run in which any test skipped, apart from the GPU tests.

A skip is a pass that checked nothing: a renamed module behind an ``importorskip``, a missing
etcd binary or a missing dev dependency would otherwise leave CI green with the tests gone.
Under ``CI=true`` every skipped test (and every module skipped whole) is named at the end of the
run and the run's exit status becomes "tests failed". Tests marked ``gpu`` may skip: CI has no
GPU.

``tests/conftest.py`` imports :func:`pytest_configure`, which registers :class:`SkipLedger` in
the process that reports the run: the single pytest process, or the pytest-xdist controller,
which receives every worker's reports through the same hooks. Workers register nothing.
"""

from __future__ import annotations

import os
from typing import Final

import pytest

#: Environment variable set by CI services; ``true`` (or ``1``) makes skips fail the run.
CI_VARIABLE: Final = "CI"
#: Tests with this marker may skip in CI (no CI machine has a GPU).
ALLOWED_MARKER: Final = "gpu"


def ci_forbids_skips() -> bool:
    """Whether this is a CI run, where skips fail the run."""
    return os.environ.get(CI_VARIABLE, "").strip().lower() in ("true", "1")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


class SkipLedger:
    """Collects the forbidden skips of one run and fails the run if there are any."""

    def __init__(self) -> None:
        self.skips: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Records a skipped test that is not marked ``gpu`` (an xfail is not a skip)."""
        if report.skipped and not hasattr(report, "wasxfail") \
                and ALLOWED_MARKER not in report.keywords:
            self.skips.append(f"{report.nodeid}: {_reason(report)}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Records a module (or class) skipped whole while it was collected."""
        if report.skipped:
            self.skips.append(f"{report.nodeid} (whole module): {_reason(report)}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Turns a run that would have passed with skips into a failed run."""
        if self.skips and session.exitstatus in (pytest.ExitCode.OK,
                                                 pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        """Names every forbidden skip and says that it failed the run."""
        if not self.skips:
            return
        terminalreporter.section("skips are failures under CI=true", sep="=", red=True,
                                 bold=True)
        for line in self.skips:
            terminalreporter.write_line(f"SKIPPED IN CI {line}")
        terminalreporter.write_line(
            f"{len(self.skips)} skip(s): only tests marked {ALLOWED_MARKER!r} may skip in CI; "
            "install what the reason names or fix the test. The run fails.")


def pytest_configure(config: pytest.Config) -> None:
    """Registers a :class:`SkipLedger` under CI in the process that reports the run."""
    if ci_forbids_skips() and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipLedger(), "elastic-no-silent-skips")
