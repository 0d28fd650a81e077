"""The JSON values of the membership protocol, and their strict parsing.

Every value elastic-run keeps in etcd is a JSON object whose ``format`` names its kind and
version (``elastic-run/node/1``, ...). Nothing is ever pickled: a value is only ever decoded
as JSON and checked field by field, so whoever can write the job's keys can at worst disturb
the job's membership, never run code on an agent. A value that is not valid JSON, names
another format, or lacks a field is refused with one :class:`RecordError` sentence that names
the key; callers log it and ignore the value (a node record) or refuse to proceed (a world
record).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from elastic_errors import ElasticError

__all__ = [
    "GENERATION_FORMAT",
    "NODE_FORMAT",
    "WORLD_FORMAT",
    "EndRecord",
    "GenerationRecord",
    "NodeRecord",
    "RecordError",
    "WorkerSlot",
    "WorldMember",
    "WorldRecord",
    "worker_id",
]

NODE_FORMAT: Final = "elastic-run/node/1"
WORLD_FORMAT: Final = "elastic-run/world/1"
GENERATION_FORMAT: Final = "elastic-run/generation/1"
END_FORMAT: Final = "elastic-run/end/1"

Mode = Literal["inplace", "restart"]


class RecordError(ElasticError):
    """An etcd value is not the elastic-run record it should be (foreign, damaged, a pickle)."""


def worker_id(node: str, local_id: str) -> str:
    """The job-wide id of a worker: ``{node}/{local_rank}.{incarnation}``."""
    return f"{node}/{local_id}"


# -- decoding helpers ------------------------------------------------------------------------


def _load(raw: bytes, key: str, expected: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RecordError(
            f"etcd key {key} holds a value that is not JSON (it starts with {raw[:12]!r}); "
            f"only elastic-run may write the job's keys: delete it or use another --job-id."
        ) from None
    if not isinstance(data, dict) or data.get("format") != expected:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise RecordError(
            f"etcd key {key} holds a {found!r} value, not an {expected!r} record; only "
            "elastic-run may write the job's keys: delete it or use another --job-id."
        )
    return data


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], key: str) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RecordError(
            f"etcd key {key} has an invalid {name!r} ({value!r}); only elastic-run may write "
            "the job's keys: delete it or use another --job-id."
        )
    return value


def _optional(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
              key: str) -> Any:
    if data.get(name) is None:
        return None
    return _field(data, name, kind, key)


def _dumps(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


# -- node records ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One worker process slot of a node, as its agent publishes it.

    Attributes:
        local_rank: The slot's index on the node.
        incarnation: Increases every time the agent starts a process for this slot.
        ready: The process can be admitted to a world now (a joiner turns ready when its
            training loop starts, so the survivors never wait for it to build its model).
        inplace: The process survives membership changes in place (its script uses
            ``ElasticLoop``); a world whose every worker says so reconfigures in place.
        pid: The process id (informational).
    """

    local_rank: int
    incarnation: int
    ready: bool = False
    inplace: bool = False
    pid: int = 0

    @property
    def local_id(self) -> str:
        """``{local_rank}.{incarnation}``: the slot's id within its node."""
        return f"{self.local_rank}.{self.incarnation}"

    def to_json(self) -> dict[str, Any]:
        return {"local_rank": self.local_rank, "incarnation": self.incarnation,
                "ready": self.ready, "inplace": self.inplace, "pid": self.pid}

    @classmethod
    def from_json(cls, data: Any, key: str) -> WorkerSlot:
        if not isinstance(data, dict):
            raise RecordError(f"etcd key {key} has an invalid worker entry ({data!r}); only "
                              "elastic-run may write the job's keys.")
        return cls(local_rank=_field(data, "local_rank", int, key),
                   incarnation=_field(data, "incarnation", int, key),
                   ready=_field(data, "ready", bool, key),
                   inplace=_field(data, "inplace", bool, key),
                   pid=_field(data, "pid", int, key))


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a node agent publishes under its own key, on its own lease.

    Written only by its agent (a put on its own key never conflicts with anyone), so a join
    costs one put and a heartbeat costs no write at all (a lease keep-alive).

    Attributes:
        node: The node id, unique per agent incarnation (``{host}-{random}``).
        host: The host name (informational).
        addr: The address peers dial: liveness probes, the process-group store.
        agent_pid: The agent's process id.
        store_port: Port of the agent's spare TCPStore server (a world may name it as the
            store its process groups rendezvous on).
        probe_port: The agent's liveness port: it accepts while the agent lives and refuses
            once it is gone, so peers tell a dead node from a silent one at once.
        workers: The node's worker slots.
        max_world: The most workers one world may have (the global batch: a larger world
            would leave ranks without samples), or ``None``.
        departing: Set when the node announced a planned departure (a preemption notice).
        waiting: ``{"epoch", "step", "workers"}`` while local workers of that world wait in
            the step's collective for longer than the hang threshold (progress rule).
        failure: ``{"epoch", "step", "error"}``: the last exception a local worker died with.
        failed_build: The newest world epoch a local worker could not build its process
            groups for (a member did not come in time), or ``None``: the leader then writes
            the same world again under a new epoch, so nobody waits for a world that never
            comes.
        restarts: Worker crashes of this node so far.
        done: Every worker of the node finished training (its part of the run is over).
        metrics_port: Port of the agent's Prometheus endpoint, or ``None``.
        create_revision: etcd revision that created the key (join order; not serialized).
    """

    node: str
    host: str
    addr: str
    agent_pid: int
    store_port: int
    probe_port: int = 0
    workers: tuple[WorkerSlot, ...] = ()
    max_world: int | None = None
    departing: dict[str, Any] | None = None
    waiting: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    failed_build: int | None = None
    restarts: int = 0
    done: bool = False
    metrics_port: int | None = None
    create_revision: int = field(default=0, compare=False)

    def ready_workers(self) -> tuple[WorkerSlot, ...]:
        """The slots that can be admitted now, in local-rank order."""
        return tuple(sorted((w for w in self.workers if w.ready), key=lambda w: w.local_rank))

    def with_changes(self, **changes: Any) -> NodeRecord:
        """A copy with ``changes`` applied (records are immutable)."""
        return replace(self, **changes)

    def dumps(self) -> bytes:
        """The JSON value of the node key."""
        return _dumps({
            "format": NODE_FORMAT, "node": self.node, "host": self.host, "addr": self.addr,
            "agent_pid": self.agent_pid, "store_port": self.store_port,
            "probe_port": self.probe_port, "workers": [w.to_json() for w in self.workers],
            "max_world": self.max_world, "departing": self.departing, "waiting": self.waiting,
            "failure": self.failure, "failed_build": self.failed_build,
            "restarts": self.restarts, "done": self.done,
            "metrics_port": self.metrics_port,
        })

    @classmethod
    def loads(cls, raw: bytes, key: str, *, create_revision: int = 0) -> NodeRecord:
        """Parses a node key's value.

        Raises:
            RecordError: If the value is not an elastic-run node record.
        """
        data = _load(raw, key, NODE_FORMAT)
        workers = _field(data, "workers", list, key)
        return cls(
            node=_field(data, "node", str, key), host=_field(data, "host", str, key),
            addr=_field(data, "addr", str, key), agent_pid=_field(data, "agent_pid", int, key),
            store_port=_field(data, "store_port", int, key),
            probe_port=_field(data, "probe_port", int, key),
            workers=tuple(WorkerSlot.from_json(w, key) for w in workers),
            max_world=_optional(data, "max_world", int, key),
            departing=_optional(data, "departing", dict, key),
            waiting=_optional(data, "waiting", dict, key),
            failure=_optional(data, "failure", dict, key),
            failed_build=_optional(data, "failed_build", int, key),
            restarts=_field(data, "restarts", int, key),
            done=_field(data, "done", bool, key),
            metrics_port=_optional(data, "metrics_port", int, key),
            create_revision=create_revision,
        )


# -- the world record ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorldMember:
    """One node's part of a world: its workers, in rank order.

    Attributes:
        node: The node id.
        addr: The node's address.
        probe_port: The node agent's liveness port.
        workers: Local ids (``{local_rank}.{incarnation}``) of the node's workers in this
            world, in local-rank order.
    """

    node: str
    addr: str
    workers: tuple[str, ...]
    probe_port: int = 0


@dataclass(frozen=True, slots=True)
class WorldRecord:
    """The one agreed world: who trains, with which ranks, on which store.

    Written only by compare-and-swap on its mod revision (etcd's Raft log is the fencing
    token), so two proposals for the same epoch can never both win. Agent rounds (restart
    mode) and in-place reconfigurations are the same sequence of epochs.

    Attributes:
        epoch: Increases with every new world.
        members: The nodes of the world in rank order; a worker's global rank is its index
            in :meth:`ranks`.
        store: ``(addr, port)`` of the TCPStore server the world's process groups rendezvous
            on, hosted by a member's agent (keys under ``e{epoch}/``).
        mode: ``"inplace"`` when every worker survives membership changes in place (the
            world then reconfigures without restarts), else ``"restart"``.
        departed: Workers of the previous world left out because their node departs on a
            notice: a planned change (survivors switch at a step boundary, nobody aborts).
        evicted: Workers of the previous world left out because every other worker waited
            for them (the progress rule): their agents stop them.
        lost: Workers of the previous world that are gone (dead, not ready, their node's
            lease lost): the cause of this world, so that a worker that failed at the same
            time can tell a peer's failure from its own.
        cause: Why this world was written: ``start``, ``node_joined``, ``node_lost`` (a
            node's record is gone), ``worker_failed`` (a worker of a live node is gone),
            ``planned_departure``, ``worker_evicted`` or ``""`` (unknown).
        revision: The key's mod revision (the CAS token; not serialized).
    """

    epoch: int
    members: tuple[WorldMember, ...]
    store: tuple[str, int]
    mode: Mode = "restart"
    departed: tuple[str, ...] = ()
    evicted: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    cause: str = ""
    revision: int = field(default=0, compare=False)

    def ranks(self) -> tuple[str, ...]:
        """Job-wide worker ids (:func:`worker_id`) in rank order."""
        return tuple(worker_id(m.node, w) for m in self.members for w in m.workers)

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return sum(len(m.workers) for m in self.members)

    def nodes(self) -> tuple[str, ...]:
        """Node ids in rank order."""
        return tuple(m.node for m in self.members)

    def member(self, node: str) -> WorldMember | None:
        """The entry of ``node``, if it is a member."""
        for member in self.members:
            if member.node == node:
                return member
        return None

    def node_rank(self, node: str) -> int:
        """The node's index among the members (``-1`` if absent)."""
        for index, member in enumerate(self.members):
            if member.node == node:
                return index
        return -1

    def rank_offset(self, node: str) -> int:
        """Global rank of the node's first worker (``-1`` if absent)."""
        offset = 0
        for member in self.members:
            if member.node == node:
                return offset
            offset += len(member.workers)
        return -1

    def with_changes(self, **changes: Any) -> WorldRecord:
        """A copy with ``changes`` applied (records are immutable)."""
        return replace(self, **changes)

    def same_composition(self, other: WorldRecord | None) -> bool:
        """Whether ``other`` has exactly these workers in this order (epochs aside)."""
        return other is not None and self.ranks() == other.ranks()

    def dumps(self) -> bytes:
        """The JSON value of the world key."""
        return _dumps({
            "format": WORLD_FORMAT, "epoch": self.epoch, "mode": self.mode,
            "store": {"addr": self.store[0], "port": self.store[1]},
            "departed": list(self.departed), "evicted": list(self.evicted),
            "lost": list(self.lost), "cause": self.cause,
            "members": [{"node": m.node, "addr": m.addr, "probe_port": m.probe_port,
                         "workers": list(m.workers)} for m in self.members],
        })

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict (what agents send their workers)."""
        data: dict[str, Any] = json.loads(self.dumps())
        data["revision"] = self.revision
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], key: str = "world") -> WorldRecord:
        """Builds the record from :meth:`to_json`'s dict (the agent channel's copy).

        Raises:
            RecordError: If the dict is not a world record.
        """
        return cls.loads(json.dumps(dict(data)).encode(), key,
                         revision=int(data.get("revision", 0)))

    @classmethod
    def loads(cls, raw: bytes, key: str, *, revision: int = 0) -> WorldRecord:
        """Parses the world key's value.

        Raises:
            RecordError: If the value is not an elastic-run world record.
        """
        data = _load(raw, key, WORLD_FORMAT)
        store = _field(data, "store", dict, key)
        members = []
        for entry in _field(data, "members", list, key):
            # Every agent (and every worker) parses the world after each change, and it names
            # every node: the common case is checked in one expression, the error below.
            node, addr, port, workers = (entry.get("node"), entry.get("addr"),
                                         entry.get("probe_port"), entry.get("workers")
                                         ) if type(entry) is dict else (None,) * 4
            if (type(node) is not str or type(addr) is not str or type(port) is not int
                    or type(workers) is not list or not _all_str(workers)):
                raise _member_error(entry, key)
            members.append(WorldMember(node, addr, tuple(workers), port))
        mode = data.get("mode")
        if mode not in ("inplace", "restart"):
            raise RecordError(f"etcd key {key} has an invalid 'mode' ({mode!r}); only "
                              "elastic-run may write the job's keys.")
        lists = {}
        for name in ("departed", "evicted", "lost"):
            ids = _field(data, name, list, key)
            if not all(isinstance(i, str) for i in ids):
                raise RecordError(f"etcd key {key} has an invalid {name!r} ({ids!r}); only "
                                  "elastic-run may write the job's keys.")
            lists[name] = tuple(ids)
        return cls(epoch=_field(data, "epoch", int, key), members=tuple(members),
                   store=(_field(store, "addr", str, key), _field(store, "port", int, key)),
                   mode=mode, departed=lists["departed"], evicted=lists["evicted"],
                   lost=lists["lost"], cause=str(data.get("cause") or ""),
                   revision=revision)


def _all_str(items: list[Any]) -> bool:
    """Whether every item is a ``str`` (``str.join`` checks it at C speed)."""
    try:
        "".join(items)
    except TypeError:
        return False
    return True


def _member_error(entry: Any, key: str) -> RecordError:
    """The one-sentence error for an invalid member entry of a world record."""
    if not isinstance(entry, dict):
        return RecordError(f"etcd key {key} has an invalid member ({entry!r}); only "
                           "elastic-run may write the job's keys.")
    for name, kind in (("node", str), ("addr", str), ("probe_port", int), ("workers", list)):
        try:
            _field(entry, name, kind, key)
        except RecordError as exc:
            return exc
    return RecordError(f"etcd key {key} has invalid worker ids ({entry['workers']!r}); "
                       "only elastic-run may write the job's keys.")


# -- job lifetime ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """Which run of a job id is current, so that a finished job's id can be reused.

    Attributes:
        generation: Increases each time the job id starts a fresh run.
        state: ``"running"``, ``"finished"`` or ``"failed"``.
        revision: The key's mod revision (not serialized).
    """

    generation: int
    state: Literal["running", "finished", "failed"] = "running"
    revision: int = field(default=0, compare=False)

    def dumps(self) -> bytes:
        return _dumps({"format": GENERATION_FORMAT, "generation": self.generation,
                       "state": self.state})

    @classmethod
    def loads(cls, raw: bytes, key: str, *, revision: int = 0) -> GenerationRecord:
        data = _load(raw, key, GENERATION_FORMAT)
        state = data.get("state")
        if state not in ("running", "finished", "failed"):
            raise RecordError(f"etcd key {key} has an invalid 'state' ({state!r}); only "
                              "elastic-run may write the job's keys.")
        return cls(_field(data, "generation", int, key), state, revision)


@dataclass(frozen=True, slots=True)
class EndRecord:
    """How a run ended: written once, by the first agent that knows.

    Attributes:
        outcome: ``"finished"`` (training completed) or ``"failed"``.
        reason: One sentence: why the run ended (for a failure, the script's own error
            where that is the cause).
        step: The last step trained, if known.
    """

    outcome: Literal["finished", "failed"]
    reason: str
    step: int | None = None

    def dumps(self) -> bytes:
        return _dumps({"format": END_FORMAT, "outcome": self.outcome, "reason": self.reason,
                       "step": self.step})

    @classmethod
    def loads(cls, raw: bytes, key: str) -> EndRecord:
        data = _load(raw, key, END_FORMAT)
        outcome = data.get("outcome")
        if outcome not in ("finished", "failed"):
            raise RecordError(f"etcd key {key} has an invalid 'outcome' ({outcome!r}); only "
                              "elastic-run may write the job's keys.")
        return cls(outcome, _field(data, "reason", str, key),
                   _optional(data, "step", int, key))


def parse_nodes(items: Sequence[tuple[str, bytes, int]],
                on_error: Any = None) -> list[NodeRecord]:
    """Parses ``(key, value, create_revision)`` triples, skipping (and reporting) bad ones.

    Args:
        items: The node keys.
        on_error: Called with each :class:`RecordError` (e.g. a logger's ``warning``).
    """
    found = []
    for key, raw, create_revision in items:
        try:
            found.append(NodeRecord.loads(raw, key, create_revision=create_revision))
        except RecordError as exc:
            if on_error is not None:
                on_error(exc)
    return found
