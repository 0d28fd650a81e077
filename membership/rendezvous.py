"""torchrun's entry point to elastic-run's rendezvous (``--rdzv-backend etcd-v3``).

This module is the target of the ``torchrun.handlers`` entry points ``etcd-v3`` and
``elastic-etcd-v3``. torch loads it while ``torch.distributed.elastic.rendezvous`` is being
imported, so it imports nothing heavy at module level and :func:`torchrun_handler` never
raises; the handler itself lives in :mod:`membership.torch_handler`. The protocol, its keys
and its ``--rdzv-conf`` keys are described in :mod:`membership` and
:mod:`membership.config`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["create_rdzv_handler", "torchrun_handler"]


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Creates the rendezvous handler torchrun's agent uses (see the module docstring).

    Raises:
        ConfigError: For a bad ``--rdzv-conf`` value or endpoint.
        RendezvousConnectionError: When etcd is unreachable within the deadline.
    """
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from elastic_errors import EtcdUnavailableError
    from membership.config import RdzvConf, client_for
    from membership.torch_handler import EtcdV3RendezvousHandler

    _log_with_torchrun()
    conf = RdzvConf.parse(params.config)
    client = client_for(params.endpoint, conf)
    try:
        return EtcdV3RendezvousHandler(params, client, conf)
    except EtcdUnavailableError as exc:
        raise RendezvousConnectionError(str(exc)) from exc


def _log_with_torchrun() -> None:
    """Prints the rendezvous' own log lines next to torchrun's agent's, at its ``LOGLEVEL``.

    torchrun prints through ``torch.distributed``'s handler and leaves the root logger bare, so
    this package's INFO lines (who leads, which world was written, why a node was dropped)
    would be dropped. An application that configured logging itself is left alone.
    """
    ours = logging.getLogger("membership")
    torch_handlers = logging.getLogger("torch.distributed").handlers
    if ours.handlers or logging.getLogger().handlers or not torch_handlers:
        return
    try:
        ours.setLevel(os.environ.get("LOGLEVEL", "WARNING").upper())
    except ValueError:
        return  # torchrun itself reports a LOGLEVEL it cannot use
    for handler in torch_handlers:
        ours.addHandler(handler)
    ours.propagate = False


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the handler creator (never raises)."""
    return create_rdzv_handler
