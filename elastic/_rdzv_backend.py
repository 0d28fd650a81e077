"""The etcd v3 ``RendezvousBackend`` (private; import it from :mod:`elastic.rendezvous`).

Kept apart from :mod:`elastic.rendezvous` because it imports torch's dynamic rendezvous at module
level, and that module must stay import-light for torch's entry-point loader.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic.errors import ConfigError, EtcdUnavailableError
from elastic.etcd import EtcdClient, KeyValue, Lease
from elastic.rendezvous import STATE_MAGIC

logger = logging.getLogger(__name__)


def frame_function_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up, as torch's ``get_method_name`` returns it.

    torch's dynamic rendezvous names every recorded event with ``get_method_name()``, which
    calls ``inspect.stack()`` twice: that builds source context for every frame of the stack
    (a stat and a linecache lookup per frame) on every rendezvous action. With many agents
    racing for the state, most of an agent's CPU went there (py-spy, 128 simulated agents).
    Walking the frames answers the same in microseconds.
    """
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


# The one place a private torch name is replaced; a unit test pins it against torch's version.
dynamic_rendezvous.get_method_name = frame_function_name


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds torch's rendezvous state in one etcd key, written by compare-and-swap.

    The fencing token is the key's mod revision: a write succeeds only if nobody wrote since
    the caller read, and a lost race returns the current state in the same round trip, as the
    ``RendezvousBackend`` contract asks. A token that is not a revision never writes.

    Every write attaches the writer's long lease (``state_ttl``), kept alive by a daemon
    thread, so the key of a job whose agents are all gone disappears by itself, while any live
    agent's heartbeat (a write) keeps it.

    Args:
        client: the etcd client.
        run_id: the job id.
        key_prefix: prefix of every key of elastic-run.
        name: the backend name torch's registry knows this backend by (``params.backend``).
        state_ttl: seconds the state outlives the last agent that wrote it; 0 keeps it forever.

    Raises:
        ConfigError: for an empty ``run_id`` or a negative ``state_ttl``.
    """

    def __init__(
        self, client: EtcdClient, run_id: str, *, key_prefix: str = "/elastic",
        name: str = "etcd-v3", state_ttl: int = 7200,
    ) -> None:
        if not run_id or "/" in run_id:
            raise ConfigError(
                f"the job id ({run_id!r}) must be non-empty and contain no '/'; pass --job-id."
            )
        if state_ttl < 0:
            raise ConfigError(f"--rdzv-conf state_ttl ({state_ttl}) must not be negative.")
        self._client = client
        self._name = name
        self._state_ttl = state_ttl
        self._lease: Lease | None = None
        self._lease_lock = threading.Lock()
        self.key = f"{key_prefix.rstrip('/')}/{run_id}/rdzv/state"

    def __repr__(self) -> str:
        return f"EtcdV3RendezvousBackend(name={self._name!r}, key={self.key!r})"

    @property
    def name(self) -> str:
        """See base class."""
        return self._name

    def _decode(self, raw: bytes) -> bytes:
        if not raw.startswith(STATE_MAGIC):
            raise RendezvousStateError(
                f"The rendezvous state under etcd key {self.key} is corrupt (it starts with "
                f"{raw[:8]!r}, not {STATE_MAGIC!r}); delete the key or use a new --job-id."
            )
        return raw[len(STATE_MAGIC):]

    def _answer(self, current: KeyValue | None, written: bool) -> tuple[bytes, Any, bool] | None:
        if current is None:
            return None
        return self._decode(current.value), current.mod_revision, written

    def _lease_id(self) -> int:
        if not self._state_ttl:
            return 0
        with self._lease_lock:
            if self._lease is None or self._lease.lost.is_set():
                self._lease = self._client.lease(self._state_ttl)
            return self._lease.id

    def get_state(self) -> tuple[bytes, Any] | None:
        """See base class."""
        current = self._client.get(self.key)
        if current is None:
            return None
        return self._decode(current.value), current.mod_revision

    def set_state(
        self, state: bytes, token: Any | None = None
    ) -> tuple[bytes, Any, bool] | None:
        """See base class."""
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            return self._answer(self._client.get(self.key), False)  # never write on a bad token
        value = STATE_MAGIC + state
        try:
            written, current = self._client.cas(self.key, value, token, lease=self._lease_id())
        except EtcdUnavailableError as exc:
            if "lease not found" not in str(exc):
                raise
            # The lease expired while etcd was unreachable for longer than state_ttl.
            with self._lease_lock:
                if self._lease is not None:
                    self._lease.lost.set()
            written, current = self._client.cas(self.key, value, token, lease=self._lease_id())
        return self._answer(current, written)

    def close(self) -> None:
        """Stops refreshing the state lease without revoking it (others may still need the key)."""
        with self._lease_lock:
            if self._lease is not None:
                self._lease.stop()
