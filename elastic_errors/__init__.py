"""The errors every elastic-run package shares, in the one place that imports none of them.

The packages depend on each other in one direction: ``launch`` (the launcher and node agent)
uses ``membership`` (the control plane: etcd, the rendezvous, liveness) and ``elastic`` (the
runtime a training script imports), which uses ``checkpointing`` (the checkpoint manager);
``membership`` reaches ``elastic`` only through its contract (``elastic.contract``,
``elastic.env``), and no worker-side module imports ``membership``. All of them use this
package and ``torch_private`` (torch's private APIs, in one place), which use nothing of
theirs. Each package keeps its own errors beside its code
(``checkpointing.errors``, ``elastic.contract.records``) and derives them from
:class:`ElasticError`, so ``except ElasticError`` catches every error elastic-run raises on its
own account.

Every message is one sentence that names the offending value in parentheses and says what to
do next.
"""

from __future__ import annotations

__all__ = ["ConfigError", "ElasticError", "EtcdAccessError", "EtcdUnavailableError",
           "JobFatalError"]


class ElasticError(Exception):
    """Base class of every error elastic-run raises on its own account."""


class ConfigError(ElasticError, ValueError):
    """A configuration value (flag, ``--rdzv-conf`` key, environment variable) is invalid."""


class EtcdUnavailableError(ElasticError, ConnectionError):
    """No etcd endpoint answered within the configured deadline."""


class EtcdAccessError(EtcdUnavailableError):
    """etcd answered but refused this client (TLS trust, client certificate, credentials or
    permissions); retrying cannot help, so it is raised at once rather than at the deadline."""


class JobFatalError(ElasticError):
    """A worker's verdict on the whole job: the job ends at once with this error (one
    sentence), instead of the worker being restarted into the same fault."""
