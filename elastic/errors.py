"""Errors raised by elastic-run's runtime (``elastic`` package).

Every message is one sentence that names the offending value in parentheses and says what to
do next. The rendezvous layer raises torch's own rendezvous error types (which the elastic
agent already knows how to handle); the classes here cover everything else.
"""

from __future__ import annotations


class ElasticError(Exception):
    """Base class of every error elastic-run raises on its own account."""


class ConfigError(ElasticError, ValueError):
    """A configuration value (flag, ``--rdzv-conf`` key, environment variable) is invalid."""


class EtcdUnavailableError(ElasticError, ConnectionError):
    """No etcd endpoint answered within the configured deadline."""


class EtcdAccessError(EtcdUnavailableError):
    """etcd answered but refused this client (TLS trust, client certificate, credentials or
    permissions); retrying cannot help, so it is raised at once rather than at the deadline."""


class MembershipChangedError(ElasticError):
    """Control flow, not a failure: the set of nodes changed and the step must be abandoned."""
