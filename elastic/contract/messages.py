"""The typed messages of the local channel between a node agent and its workers.

The channel (:mod:`launch.channel` on the agent's side, :mod:`elastic.agent_link` on the
worker's) carries one JSON object per line, ``{"type": KIND, field: value, ...}``. Each kind
is one frozen dataclass here; :func:`encode` writes it and :func:`decode_worker_message` /
:func:`decode_agent_message` read it back, field by field, refusing a line that is not one of
them with :class:`MessageError` (one sentence naming the kind and the field).

Workers send the 14 kinds of :data:`WORKER_MESSAGES` (``hello`` first, then ``heartbeat``
about twice a second and the rest as things happen); agents send :data:`AGENT_MESSAGES`
(``welcome`` answers ``hello``). ``docs/agent.md`` says what each is for.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Final, Literal, TypeAlias

from elastic.contract.records import RecordError, WorldRecord
from elastic_errors import ElasticError

__all__ = [
    "AGENT_MESSAGES",
    "WORKER_MESSAGES",
    "AgentMessage",
    "BuildFailed",
    "Declare",
    "Drained",
    "End",
    "Evict",
    "Exiting",
    "Failure",
    "Finished",
    "Gone",
    "Heartbeat",
    "Hello",
    "Lease",
    "MessageError",
    "Progress",
    "Ready",
    "Resumed",
    "StallRule",
    "Stalled",
    "Suspect",
    "Waiting",
    "Welcome",
    "WorkerMessage",
    "World",
    "decode_agent_message",
    "decode_worker_message",
    "encode",
]


class MessageError(ElasticError, ValueError):
    """A channel line that is not one of the contract's messages."""


# -- worker -> agent -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker's first message: which slot and which start of it it is."""

    KIND: ClassVar[str] = "hello"
    local_rank: int
    incarnation: int
    pid: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The worker's process still runs (sent from a thread of its own)."""

    KIND: ClassVar[str] = "heartbeat"


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker's training loop started (it may be placed in a world)."""

    KIND: ClassVar[str] = "ready"
    inplace: bool = False
    max_world: int | None = None


@dataclass(frozen=True, slots=True)
class Declare:
    """The worker reconfigures in place (it uses ``ElasticLoop``), before it is ready."""

    KIND: ClassVar[str] = "declare"
    inplace: bool = True
    max_world: int | None = None


@dataclass(frozen=True, slots=True)
class Progress:
    """The worker completed steps up to ``step`` (exclusive); -1 before its first."""

    KIND: ClassVar[str] = "progress"
    step: int


@dataclass(frozen=True, slots=True)
class Stalled:
    """The worker has waited in the collective of ``step`` (world ``epoch``) long enough for
    its agent to look for a silent peer (:class:`StallRule`)."""

    KIND: ClassVar[str] = "stalled"
    epoch: int
    step: int


@dataclass(frozen=True, slots=True)
class Waiting:
    """The worker has waited in the collective of ``step`` past the hang threshold."""

    KIND: ClassVar[str] = "waiting"
    epoch: int
    step: int


@dataclass(frozen=True, slots=True)
class Resumed:
    """The step the worker waited in completed."""

    KIND: ClassVar[str] = "resumed"


@dataclass(frozen=True, slots=True)
class BuildFailed:
    """The worker could not build world ``epoch``'s process groups."""

    KIND: ClassVar[str] = "build_failed"
    epoch: int


@dataclass(frozen=True, slots=True)
class Suspect:
    """A collective of the worker failed: these nodes of its world may be gone."""

    KIND: ClassVar[str] = "suspect"
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """What the worker is dying of: ``error`` (``Type: first line``), the ``step`` it was at,
    whether membership evidence says a ``peer``'s failure caused it, whether the error is of
    a type a peer's failure causes (``peer_type``), and whether it is a verdict on the whole
    job (``fatal``: :class:`~elastic_errors.JobFatalError`)."""

    KIND: ClassVar[str] = "failure"
    error: str
    step: int = -1
    peer: bool = False
    peer_type: bool | None = None
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class Drained:
    """The worker stopped at a step boundary after a final checkpoint (not a failure)."""

    KIND: ClassVar[str] = "drained"
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The rank-0 worker trained the last step: the run is over."""

    KIND: ClassVar[str] = "finished"
    step: int = -1


@dataclass(frozen=True, slots=True)
class Exiting:
    """The worker's interpreter is shutting down (its heartbeat thread stops first)."""

    KIND: ClassVar[str] = "exiting"


WorkerMessage: TypeAlias = (Hello | Heartbeat | Ready | Declare | Progress | Stalled | Waiting
                            | Resumed | BuildFailed | Suspect | Failure | Drained | Finished
                            | Exiting)
WORKER_MESSAGES: Final[tuple[type[Any], ...]] = (
    Hello, Heartbeat, Ready, Declare, Progress, Stalled, Waiting, Resumed, BuildFailed,
    Suspect, Failure, Drained, Finished, Exiting)


# -- agent -> worker -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StallRule:
    """When a worker reports ``stalled``: after waiting in a collective for
    ``max(floor_s, factor x median step time)`` (the agent's silent-peer check then starts;
    the rule itself lives in :mod:`membership.silent_peers`)."""

    floor_s: float
    factor: float


@dataclass(frozen=True, slots=True)
class End:
    """How the run ended."""

    KIND: ClassVar[str] = "end"
    outcome: Literal["finished", "failed"]
    reason: str
    step: int | None = None


@dataclass(frozen=True, slots=True)
class Welcome:
    """The agent's answer to ``hello``: who the worker is and what it needs to know now."""

    KIND: ClassVar[str] = "welcome"
    node: str
    worker: str
    stall: StallRule
    world: WorldRecord | None = None
    lease_ok: bool = True
    end: End | None = None


@dataclass(frozen=True, slots=True)
class World:
    """A new world."""

    KIND: ClassVar[str] = "world"
    world: WorldRecord


@dataclass(frozen=True, slots=True)
class Lease:
    """Whether the node's lease is fresh (its workers may commit checkpoints)."""

    KIND: ClassVar[str] = "lease"
    lease_ok: bool


@dataclass(frozen=True, slots=True)
class Gone:
    """Job-wide ids of local workers that died."""

    KIND: ClassVar[str] = "gone"
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Evict:
    """The agent evicted this worker."""

    KIND: ClassVar[str] = "evict"
    reason: str


AgentMessage: TypeAlias = Welcome | World | Lease | End | Gone | Evict
AGENT_MESSAGES: Final[tuple[type[Any], ...]] = (Welcome, World, Lease, End, Gone, Evict)


# -- the wire --------------------------------------------------------------------------------


def _wire(value: Any) -> Any:
    if isinstance(value, WorldRecord):
        return value.to_json()
    if isinstance(value, StallRule | End):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, tuple):
        return list(value)
    return value


def encode(message: WorkerMessage | AgentMessage) -> bytes:
    """One channel line: ``{"type": KIND, ...fields}`` as JSON, with its newline."""
    body = {"type": message.KIND,
            **{f.name: _wire(getattr(message, f.name)) for f in fields(message)}}
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def _checked(check: Callable[[Any], bool], what: str) -> Callable[[Any], Any]:
    """A field parser that passes values ``check`` accepts and refuses others as ``what``."""
    def parse(value: Any) -> Any:
        if not check(value):
            raise TypeError(what)
        return float(value) if what == "a number" else value
    return parse


_int = _checked(lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_number = _checked(lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number")
_bool = _checked(lambda v: isinstance(v, bool), "true or false")
_str = _checked(lambda v: isinstance(v, str), "a string")
_outcome = _checked(lambda v: v in ("finished", "failed"), "'finished' or 'failed'")


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("a list of strings")
    return tuple(value)


def _world(value: Any) -> WorldRecord:
    if not isinstance(value, dict):
        raise TypeError("a world record")
    try:
        return WorldRecord.from_json(value)
    except RecordError as exc:
        raise TypeError(f"a world record ({exc})") from None


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


def _nested(kind: type[Any], parsers: Mapping[str, Callable[[Any], Any]]
            ) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError("an object")
        return kind(**{name: parse_field(value.get(name)) for name, parse_field in
                       parsers.items() if name in value})
    return parse


_END_FIELDS: Final = {"outcome": _outcome, "reason": _str, "step": _optional(_int)}
#: How each field of each kind is read.
_PARSERS: Final[Mapping[type[Any], Mapping[str, Callable[[Any], Any]]]] = {
    Hello: {"local_rank": _int, "incarnation": _int, "pid": _int},
    Heartbeat: {},
    Ready: {"inplace": _bool, "max_world": _optional(_int)},
    Declare: {"inplace": _bool, "max_world": _optional(_int)},
    Progress: {"step": _int},
    Stalled: {"epoch": _int, "step": _int},
    Waiting: {"epoch": _int, "step": _int},
    Resumed: {},
    BuildFailed: {"epoch": _int},
    Suspect: {"nodes": _strings},
    Failure: {"error": _str, "step": _int, "peer": _bool, "peer_type": _optional(_bool),
              "fatal": _bool},
    Drained: {"step": _optional(_int)},
    Finished: {"step": _int},
    Exiting: {},
    Welcome: {"node": _str, "worker": _str,
              "stall": _nested(StallRule, {"floor_s": _number, "factor": _number}),
              "world": _optional(_world), "lease_ok": _bool,
              "end": _optional(_nested(End, _END_FIELDS))},
    World: {"world": _world},
    Lease: {"lease_ok": _bool},
    End: _END_FIELDS,
    Gone: {"workers": _strings},
    Evict: {"reason": _str},
}


def _decode(raw: Mapping[str, Any], kinds: tuple[type[Any], ...], side: str) -> Any:
    by_kind = {k.KIND: k for k in kinds}
    name = raw.get("type")
    kind = by_kind.get(name) if isinstance(name, str) else None
    if kind is None:
        raise MessageError(f"the channel message type ({name!r}) is not one {side} sends; "
                           "the agent and its workers must run the same elastic-run.")
    values = {}
    for field_name, parse in _PARSERS[kind].items():
        if field_name not in raw:
            continue  # the dataclass says whether it has a default
        try:
            values[field_name] = parse(raw[field_name])
        except TypeError as exc:
            raise MessageError(
                f"the {name!r} message's {field_name!r} ({raw[field_name]!r}) must be {exc}; "
                "the agent and its workers must run the same elastic-run.") from None
    try:
        return kind(**values)
    except TypeError:
        missing = [f.name for f in fields(kind) if f.name not in values
                   and f.default is MISSING and f.default_factory is MISSING]
        raise MessageError(f"the {name!r} message lacks a field ({', '.join(missing)}); the "
                           "agent and its workers must run the same elastic-run.") from None


def decode_worker_message(raw: Mapping[str, Any]) -> WorkerMessage:
    """Reads one decoded JSON object a worker sent (raises :class:`MessageError`)."""
    message: WorkerMessage = _decode(raw, WORKER_MESSAGES, "a worker")
    return message


def decode_agent_message(raw: Mapping[str, Any]) -> AgentMessage:
    """Reads one decoded JSON object an agent sent (raises :class:`MessageError`)."""
    message: AgentMessage = _decode(raw, AGENT_MESSAGES, "an agent")
    return message
