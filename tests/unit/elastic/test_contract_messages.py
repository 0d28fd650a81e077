"""The channel's typed messages: every kind survives the wire, and a bad line is refused with
one sentence naming the kind and the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from elastic.contract.messages import (
    AGENT_MESSAGES,
    WORKER_MESSAGES,
    BuildFailed,
    Declare,
    Drained,
    End,
    Evict,
    Exiting,
    Failure,
    Finished,
    Gone,
    Heartbeat,
    Hello,
    Lease,
    MessageError,
    Progress,
    Ready,
    Resumed,
    Stalled,
    StallRule,
    Suspect,
    Waiting,
    Welcome,
    World,
    decode_agent_message,
    decode_worker_message,
    encode,
)
from elastic.contract.records import WorldMember, WorldRecord

WORLD = WorldRecord(4, (WorldMember("n0", "10.0.0.1", ("0.1", "1.1"), 4000),),
                    ("10.0.0.1", 5000), "inplace", revision=17)

WORKER_SAMPLES: list[Any] = [
    Hello(0, 2, 1234), Heartbeat(), Ready(inplace=True, max_world=64), Declare(),
    Progress(7), Stalled(4, 7), Waiting(4, 7), Resumed(), BuildFailed(4),
    Suspect(("n1", "n2")), Failure("RuntimeError: boom", 7, peer=False, peer_type=True),
    Drained(7), Drained(), Finished(60), Exiting(),
]
AGENT_SAMPLES: list[Any] = [
    Welcome("n0", "n0/0.2", StallRule(0.5, 3.0), WORLD, lease_ok=False,
            end=End("failed", "the script failed", 3)),
    Welcome("n0", "n0/0.2", StallRule(0.5, 3.0)),
    World(WORLD), Lease(True), End("finished", "training finished", 60), Gone(("n0/0.1",)),
    Evict("held the step back"),
]


def _wire(message: Any) -> dict[str, Any]:
    line = encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    raw = json.loads(line)
    assert isinstance(raw, dict)
    return raw


def test_every_kind_has_a_sample() -> None:
    assert {type(m) for m in WORKER_SAMPLES} == set(WORKER_MESSAGES)
    assert len(WORKER_MESSAGES) == 14
    assert {type(m) for m in AGENT_SAMPLES} == set(AGENT_MESSAGES)


@pytest.mark.parametrize("message", WORKER_SAMPLES, ids=lambda m: type(m).__name__)
def test_a_worker_message_survives_the_wire(message: Any) -> None:
    assert decode_worker_message(_wire(message)) == message


@pytest.mark.parametrize("message", AGENT_SAMPLES, ids=lambda m: type(m).__name__)
def test_an_agent_message_survives_the_wire(message: Any) -> None:
    decoded = decode_agent_message(_wire(message))
    assert decoded == message
    if isinstance(decoded, World):
        assert decoded.world.revision == 17  # the CAS revision travels too


@pytest.mark.parametrize(("raw", "match"), [
    ({"type": "welcome", "node": "n0"}, r"'welcome' message lacks a field \(worker, stall\)"),
    ({"type": "hello", "local_rank": "0", "incarnation": 1, "pid": 2},
     r"'hello' message's 'local_rank' \('0'\) must be an integer"),
    ({"type": "progress", "step": True}, r"'progress' message's 'step' \(True\) must be an "),
    ({"type": "suspect", "nodes": "n1"}, r"'nodes' \('n1'\) must be a list of strings"),
    ({"type": "reboot"}, r"type \('reboot'\) is not one a worker sends"),
    ({"type": "world", "world": {"format": "nope"}}, r"'world' .* must be a world record"),
])
def test_a_bad_line_is_refused_naming_the_kind_and_the_field(raw: dict[str, Any],
                                                             match: str) -> None:
    decode = decode_agent_message if raw["type"] in ("welcome", "world") else \
        decode_worker_message
    with pytest.raises(MessageError, match=match):
        decode(raw)


def test_a_worker_kind_is_not_an_agent_kind() -> None:
    with pytest.raises(MessageError, match=r"not one an agent sends"):
        decode_agent_message(_wire(Progress(3)))
