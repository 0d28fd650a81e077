"""Runs of a job id: which generation an agent joins, and how a run ends.

A job id names a sequence of runs. ``{prefix}/{job}/generation`` says which run is current
and whether it is still running. An agent that starts:

* joins the current run while it runs (a new node, a replacement, or a whole job restarted
  after every node died: it resumes from its checkpoint);
* exits at once if the run ended moments ago (the run's end record, kept ``linger`` seconds
  on a lease, is still there): a replacement an autoscaler started as the job finished has
  nothing to do (exit 0), and a node that comes to a failed run fails with its reason;
* otherwise starts the next run of the id (``generation + 1``): the id can be reused for a
  fresh job once its previous run ended more than ``linger`` seconds ago.

Ending a run is done once, by the first agent that knows (the end record is created only if
absent); then the generation record says so and the run's keys are removed (node records and
the leader key go with their leases, the end record with its linger lease).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from elastic.etcd import EtcdClient
from elastic.rdzv.keys import JobKeys
from elastic.rdzv.records import EndRecord, GenerationRecord, RecordError

__all__ = ["DEFAULT_LINGER_S", "Opened", "end_run", "open_run"]

logger = logging.getLogger(__name__)

DEFAULT_LINGER_S: Final = 60
_MAX_RACES: Final = 16


@dataclass(frozen=True, slots=True)
class Opened:
    """The outcome of :func:`open_run`.

    Attributes:
        keys: The keys of the run to join (``generation`` chosen).
        ended: The end record of a run that ended moments ago (nothing to join), or ``None``.
    """

    keys: JobKeys
    ended: EndRecord | None = None


def open_run(client: EtcdClient, keys: JobKeys) -> Opened:
    """Chooses the run this agent joins (see the module docstring).

    Raises:
        RecordError: If the generation key holds something elastic-run did not write.
        EtcdUnavailableError: If etcd cannot be reached within the deadline.
    """
    for _ in range(_MAX_RACES):
        kv = client.get(keys.generation_key)
        if kv is None:
            if client.create(keys.generation_key, GenerationRecord(1).dumps()):
                logger.info("job %s: starting run 1", keys.job)
            continue  # read what was written (ours or a racing agent's)
        record = GenerationRecord.loads(kv.value, kv.key, revision=kv.mod_revision)
        run = keys.for_generation(record.generation)
        if record.state == "running":
            return Opened(run)
        end = client.get(run.end)
        if end is not None:
            try:
                return Opened(run, EndRecord.loads(end.value, end.key))
            except RecordError as exc:
                logger.warning("ignoring %s", exc)
        fresh = GenerationRecord(record.generation + 1)
        written, _ = client.cas(keys.generation_key, fresh.dumps(), kv.mod_revision)
        if written:
            logger.info("job %s: run %d %s; starting run %d (the id is reused)", keys.job,
                        record.generation, record.state, fresh.generation)
    raise RuntimeError(f"job {keys.job}: too many agents raced to start a run; try again")


def end_run(client: EtcdClient, keys: JobKeys, end: EndRecord, *,
            linger: int = DEFAULT_LINGER_S) -> bool:
    """Ends run ``keys.generation`` with ``end`` unless another agent already did.

    Returns:
        Whether this call ended it (the end record is written only once).
    """
    lease = client.grant_lease(max(1, linger))  # not kept alive: it lingers, then goes
    if not client.create(keys.end, end.dumps(), lease=lease):
        client.revoke_lease(lease)
        return False
    kv = client.get(keys.generation_key)
    if kv is not None:
        try:
            current = GenerationRecord.loads(kv.value, kv.key)
        except RecordError:
            current = None
        if current is not None and current.generation == keys.generation:
            done = GenerationRecord(keys.generation, end.outcome)
            client.cas(keys.generation_key, done.dumps(), kv.mod_revision)
    # The run's state goes; node records and the leader key expire with their leases.
    client.delete(keys.world)
    client.delete_prefix(keys.store)
    logger.info("run %d of job %s ended (%s): %s", keys.generation, keys.job, end.outcome,
                end.reason)
    return True
