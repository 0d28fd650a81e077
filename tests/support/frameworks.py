"""Framework tests need their framework: CI installs it (``.ci/run``), where a missing one
is a failure; elsewhere a test whose framework is not installed is skipped, saying so."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def framework(name: str) -> ModuleType:
    """Imports ``name``, or skips the test (fails in CI) when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed ({exc}); .ci/run installs the lightning and "
                        "hf extras.")
        pytest.skip(f"{name} is not installed ({exc}); pip install -e '.[lightning,hf]'")
