"""A node that has not reached etcd for the etcd deadline: a job-wide outage, or a cut-off node?

From inside one node both look the same: etcd does not answer, and after the client's
deadline (``--rdzv-conf deadline=``, 30 s) the agent's watch of the run gives up. What the
node's own workers did meanwhile tells them apart:

* **A job-wide etcd outage.** Every node still trains with its peers (the collectives do not
  need etcd), so this node's workers kept completing steps long after its lease was last
  refreshed. Nobody can change the world without etcd, and waiting longer only hides the
  outage: the job stops, naming the endpoints (exit 3, as before).
* **This node is cut off** (its link, or only its path to etcd). The others dropped it once
  its lease expired, a TTL after its last refresh, and moved on: its workers completed no
  step after that (their world was aborted under them, or their collectives wait for peers
  they cannot reach). This node must not take the job down; it keeps trying to reach etcd
  (up to ``join_timeout``, with a tenacity policy), and when etcd answers it either joins
  again as a new node (its lease is gone) or ends with the run's outcome if the run ended
  meanwhile (exit 0 for a finished run).

A node whose workers never reported a step (a script without ``ElasticLoop``, or a node that
had just joined) asks its peers instead: if none of the world's other nodes answers a probe
of its liveness port at its registered address, its own link is down (it is cut off); if
one answers, or there is no other node, it cannot tell and keeps the outage behaviour.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Final

from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from elastic.contract.records import GenerationRecord, RecordError
from elastic_errors import EtcdUnavailableError
from membership.job import RunMembership
from membership.liveness import probe_all

__all__ = ["Reconnect", "cut_off", "ended_while_away", "peers_answer", "workers_trained_on"]

logger = logging.getLogger(__name__)

#: How many lease TTLs after the last refresh a step must complete to prove that the job
#: still trained with this node: the others drop a cut-off node one TTL after its last
#: refresh; the second TTL covers their reaction and the step that was in flight.
TRAINED_ON_TTLS: Final = 2.0


def workers_trained_on(progress_at: float | None, refreshed_at: float | None,
                       ttl: float) -> bool:
    """Whether this node's workers kept training after it lost etcd (a job-wide outage).

    Args:
        progress_at: ``time.monotonic()`` when a worker of this node last completed a step
            (``None``: none ever reported one).
        refreshed_at: ``time.monotonic()`` of the lease's last confirmed refresh (``None``:
            no lease).
        ttl: The lease TTL in seconds.

    Returns:
        ``True`` when a step completed later than :data:`TRAINED_ON_TTLS` TTLs after the last
        refresh (the job trained on with this node: etcd itself is gone), and when there is
        no evidence either way; ``False`` when the workers stopped training about when the
        others must have dropped this node (it was cut off).
    """
    if progress_at is None or refreshed_at is None:
        return True
    return progress_at > refreshed_at + TRAINED_ON_TTLS * ttl


def cut_off(progress_at: float | None, refreshed_at: float | None, ttl: float,
            peers_answering: bool | None) -> bool:
    """Whether a node that lost etcd for the deadline is cut off from the job (see the
    module docstring).

    Args:
        progress_at: See :func:`workers_trained_on`.
        refreshed_at: See :func:`workers_trained_on`.
        ttl: The lease TTL in seconds.
        peers_answering: Whether any other node of the world answered a liveness probe
            (``None``: the world has no other node).
    """
    if progress_at is not None and refreshed_at is not None:
        return not workers_trained_on(progress_at, refreshed_at, ttl)
    return peers_answering is False


def peers_answer(addresses: Sequence[tuple[str, int]], timeout: float = 1.0) -> bool | None:
    """Whether any of ``addresses`` (other nodes' liveness ports) accepts a connection;
    ``None`` without addresses."""
    if not addresses:
        return None
    return any(alive is True for alive in probe_all(addresses, timeout).values())


def ended_while_away(record: GenerationRecord | None, generation: int
                     ) -> tuple[int, str, str] | None:
    """How run ``generation`` ended while this node could not see it, from the job's
    generation record; ``None`` while it still runs.

    Returns:
        ``(exit code, outcome, message)``: 0 if it finished; 1 if it failed, or if a newer
        run of the job id has replaced it (its outcome is no longer recorded).
    """
    if record is None:
        return 1, "failed", (f"run {generation} ended while this node was cut off from etcd "
                             "(its job's records are gone); its outcome is unknown.")
    if record.generation == generation and record.state == "running":
        return None
    if record.generation == generation and record.state == "finished":
        return 0, "already_finished", (f"run {generation} finished while this node was cut "
                                       "off from etcd.")
    if record.generation == generation:
        return 1, "failed", f"run {generation} failed while this node was cut off from etcd."
    return 1, "failed", (f"run {generation} ended while this node was cut off from etcd "
                         f"(the job id is running run {record.generation} now); its outcome "
                         "is no longer recorded.")


class Reconnect:
    """Tries, on a daemon thread, to follow the run again after the watch gave up.

    Each attempt resumes the run's watch (:meth:`~membership.etcd.PrefixWatch.resume`, which
    waits up to the client's deadline), then reads the job's generation record; attempts
    are spaced by a tenacity policy that stops ``give_up_after`` seconds after the first.

    Args:
        run: The run this node is a member of.
        give_up_after: Seconds after which it stops trying (``join_timeout``).

    Attributes:
        done: Set when it succeeded or gave up.
        error: Why it gave up (``None`` if it succeeded).
        generation: The job's generation record as read once etcd answered (``None``: the
            key was absent, or the attempt failed).
    """

    def __init__(self, run: RunMembership, *, give_up_after: float) -> None:
        self._run = run
        self._give_up_after = give_up_after
        self._stop = threading.Event()
        self.done = threading.Event()
        self.error: EtcdUnavailableError | None = None
        self.generation: GenerationRecord | None = None
        self._thread = threading.Thread(target=self._reconnect, name="elastic-reconnect",
                                        daemon=True)
        self._thread.start()

    def _attempt(self) -> None:
        if self._stop.is_set():
            return
        self._run.view.watch.resume()
        kv = self._run.client.get(self._run.keys.generation_key)
        if kv is None:
            self.generation = None
            return
        try:
            self.generation = GenerationRecord.loads(kv.value, kv.key,
                                                     revision=kv.mod_revision)
        except RecordError as exc:
            logger.warning("ignoring %s", exc)
            self.generation = GenerationRecord(self._run.keys.generation)

    def _reconnect(self) -> None:
        policy = Retrying(
            stop=stop_after_delay(self._give_up_after),
            wait=wait_exponential_jitter(initial=0.5, max=5.0),
            retry=retry_if_exception_type(EtcdUnavailableError),
            before_sleep=before_sleep_log(logger, logging.DEBUG),
            reraise=True,
        )
        try:
            policy(self._attempt)
        except EtcdUnavailableError as exc:
            self.error = exc
        except Exception as exc:  # never leave the agent waiting on a dead thread
            logger.exception("reconnecting to etcd failed")
            self.error = EtcdUnavailableError(f"reconnecting to etcd failed ({exc})")
        finally:
            self.done.set()

    def stop(self) -> None:
        """Makes the next attempt a no-op (the thread is a daemon either way)."""
        self._stop.set()
