"""The errors of elastic-run's runtime (``elastic``): the shared ones, re-exported.

They live in :mod:`elastic_errors`, which every package imports and which imports none of
them (see its docstring for the packages' direction of dependency).
"""

from __future__ import annotations

from elastic_errors import (
    ConfigError,
    ElasticError,
    EtcdAccessError,
    EtcdUnavailableError,
    JobFatalError,
)

__all__ = ["ConfigError", "ElasticError", "EtcdAccessError", "EtcdUnavailableError",
           "JobFatalError"]
