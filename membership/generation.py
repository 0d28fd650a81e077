"""Runs of a job id: which generation an agent joins, and how a run ends.

A job id names a sequence of runs. ``{prefix}/{job}/generation`` says which run is current
and whether it is still running. An agent that starts:

* joins the current run while it runs (a new node, a replacement, or a whole job restarted
  after every node died: it resumes from its checkpoint);
* otherwise starts the next run of the id (``generation + 1``) at once: running
  ``elastic-run`` again with the id of a job that ended is a fresh run, as a user expects;
* except, when ``linger`` is set (``--rdzv-conf linger=S``, off by default), within ``S``
  seconds of a run's end: then it exits at once, as a late replacement that an autoscaler
  started while the job finished should (exit 0 after a finished run, the run's reason after
  a failed one).

Starting a run is one compare-and-swap of the generation key that, in the same transaction,
deletes whatever an earlier run left (its keys are gone but for those on live leases), so a
fresh run never meets a stale world, leader or store key.

Ending a run is done once, by the first agent that knows (the end record is created only if
absent). Then nothing of the run stays without a lease: the world is deleted, node records
and the leader key go with their agents' leases, the end record and the store keys stay
``linger`` seconds (:data:`END_KEEP_S` when ``linger`` is off: the members of the run follow
the end record by watch and keep it once seen, so it stays for ``elastic-run status``; the
store stays for torchrun agents still in their exit barrier), and the
generation record, now saying how the run ended, is put on a lease of
:data:`GENERATION_KEEP_S` (a day): the id's run numbers go on if it is reused within a day,
and afterwards the id leaves no key in etcd at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from elastic.contract.records import EndRecord, GenerationRecord, RecordError
from membership.etcd import EtcdClient, KeyValue
from membership.keys import JobKeys

__all__ = ["DEFAULT_LINGER_S", "END_KEEP_S", "GENERATION_KEEP_S", "Opened", "end_run",
           "open_run"]

logger = logging.getLogger(__name__)

DEFAULT_LINGER_S: Final = 0
"""``--rdzv-conf linger`` by default: nodes that come after a run's end start a fresh run."""
END_KEEP_S: Final = 30
"""How long a run's end record stays when ``linger`` is off."""
GENERATION_KEEP_S: Final = 24 * 3600
"""How long the generation record of an ended run stays (the id's run numbers go on)."""
_MAX_RACES: Final = 16


@dataclass(frozen=True, slots=True)
class Opened:
    """The outcome of :func:`open_run`.

    Attributes:
        keys: The keys of the run to join (``generation`` chosen).
        ended: The end record of a run that ended within ``linger`` (nothing to join), or
            ``None``.
    """

    keys: JobKeys
    ended: EndRecord | None = None


def open_run(client: EtcdClient, keys: JobKeys, *, linger: int = DEFAULT_LINGER_S) -> Opened:
    """Chooses the run this agent joins (see the module docstring).

    Args:
        client: The etcd client.
        keys: The job id's keys.
        linger: Seconds after a run's end during which an arriving agent does not start a
            fresh run but reports the end (0: never).

    Raises:
        RecordError: If the generation key holds something elastic-run did not write.
        EtcdUnavailableError: If etcd cannot be reached within the deadline.
    """
    kv = client.get(keys.generation_key)
    for _ in range(_MAX_RACES):
        if kv is None:
            # The id's first run (or its last one ended more than a day ago): whatever an
            # earlier run left goes in the same transaction.
            written, kv = client.cas(keys.generation_key, GenerationRecord(1).dumps(), None,
                                     delete_range=keys.runs_range)
            if written:
                logger.info("job %s: starting run 1", keys.job)
            continue  # read what was written (ours or a racing agent's)
        record = GenerationRecord.loads(kv.value, kv.key, revision=kv.mod_revision)
        run = keys.for_generation(record.generation)
        if record.state == "running":
            return Opened(run)
        if linger > 0 and (ended := _recent_end(client, run)) is not None:
            return Opened(run, ended)
        kv = _start_next(client, keys, record, kv)
    raise RuntimeError(f"job {keys.job}: too many agents raced to start a run; try again")


def _valid(kind: type[EndRecord] | type[GenerationRecord], kv: KeyValue) -> bool:
    try:
        kind.loads(kv.value, kv.key)
    except RecordError:
        return False
    return True


def _recent_end(client: EtcdClient, run: JobKeys) -> EndRecord | None:
    end = client.get(run.end)
    if end is None:
        return None
    try:
        return EndRecord.loads(end.value, end.key)
    except RecordError as exc:
        logger.warning("ignoring %s", exc)
        return None


def _start_next(client: EtcdClient, keys: JobKeys, ended: GenerationRecord,
                kv: KeyValue) -> KeyValue | None:
    """Starts run ``ended.generation + 1`` unless a racing agent did; returns the key after."""
    fresh = GenerationRecord(ended.generation + 1)
    written, after = client.cas(keys.generation_key, fresh.dumps(), kv.mod_revision,
                                delete_range=keys.runs_range)
    if written:
        logger.info(
            "job %s: run %d %s; starting run %d (the job id is reused: a fresh run). A node "
            "meant to join run %d should have come earlier; with --rdzv-conf linger=S, nodes "
            "that come within S s of a run's end exit instead.", keys.job, ended.generation,
            ended.state, fresh.generation, ended.generation)
    return after


def end_run(client: EtcdClient, keys: JobKeys, end: EndRecord, *,
            linger: int = DEFAULT_LINGER_S) -> bool:
    """Ends run ``keys.generation`` with ``end`` unless another agent already did.

    Args:
        client: The etcd client.
        keys: The run's keys.
        end: How it ended.
        linger: Seconds the end record stays for agents that come late (0:
            :data:`END_KEEP_S`, for ``elastic-run status``).

    Returns:
        Whether this call ended it (the end record is written only once).
    """
    lease = client.grant_lease(linger if linger > 0 else END_KEEP_S)  # never kept alive
    written, current = client.cas(keys.end, end.dumps(), None, lease=lease)
    if not written and current is not None and not _valid(EndRecord, current):
        # Not an end record (foreign or damaged): it must not keep the run from ending.
        written, current = client.cas(keys.end, end.dumps(), current.mod_revision, lease=lease)
    if not written:
        client.revoke_lease(lease)
        return False
    kv = client.get(keys.generation_key)
    ours = kv is not None and (not _valid(GenerationRecord, kv) or GenerationRecord.loads(
        kv.value, kv.key).generation == keys.generation)
    if kv is not None and ours:
        # (A damaged generation record is replaced too: the id stays reusable.)
        done = GenerationRecord(keys.generation, end.outcome)
        keep = client.grant_lease(GENERATION_KEEP_S)
        if not client.cas(keys.generation_key, done.dumps(), kv.mod_revision, lease=keep)[0]:
            client.revoke_lease(keep)
    # The run's state goes; node records and the leader key expire with their leases.
    client.delete(keys.world)
    # The store goes with the end record's lease, not at once: torchrun's agents leave
    # through an exit barrier on it, and the agent that ends the run is the first one
    # through; a slower one still waiting for the barrier's last key would otherwise find
    # it deleted and wait out torch's 300 s barrier timeout.
    client.attach_prefix_to_lease(keys.store, lease)
    logger.info("run %d of job %s ended (%s): %s", keys.generation, keys.job, end.outcome,
                end.reason)
    return True
