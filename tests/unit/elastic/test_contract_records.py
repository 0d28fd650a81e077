"""The protocol's JSON records: round trips, and refusal of anything elastic-run did not write."""

from __future__ import annotations

import pickle

import pytest

from elastic.contract.records import (
    EndRecord,
    GenerationRecord,
    NodeRecord,
    RecordError,
    WorkerSlot,
    WorldMember,
    WorldRecord,
    parse_nodes,
)


def node(name: str = "h-1", *workers: WorkerSlot) -> NodeRecord:
    return NodeRecord(node=name, host="h", addr="10.0.0.1", agent_pid=7, store_port=4000,
                      workers=workers or (WorkerSlot(0, 1, True, False, 11),))


def test_node_record_round_trips_with_every_field() -> None:
    record = node("h-1", WorkerSlot(0, 2, True, True, 5), WorkerSlot(1, 1, False, False, 6))
    record = record.with_changes(max_world=12, departing={"source": "aws"},
                                 waiting={"epoch": 3, "step": 9, "workers": ["0.2"]},
                                 failure={"epoch": 3, "step": 9, "error": "ValueError: x"},
                                 restarts=2, metrics_port=9400)
    parsed = NodeRecord.loads(record.dumps(), "k", create_revision=42)
    assert parsed == record
    assert parsed.create_revision == 42
    assert [w.local_id for w in parsed.ready_workers()] == ["0.2"]


def test_world_record_round_trips_and_numbers_ranks_node_by_node() -> None:
    world = WorldRecord(5, (WorldMember("a", "10.0.0.1", ("0.1", "1.1")),
                            WorldMember("b", "10.0.0.2", ("0.3",))), ("10.0.0.1", 4000),
                        "inplace", revision=77)
    parsed = WorldRecord.loads(world.dumps(), "w", revision=77)
    assert parsed == world
    assert parsed.ranks() == ("a/0.1", "a/1.1", "b/0.3")
    assert parsed.rank_offset("b") == 2 and parsed.node_rank("b") == 1
    assert WorldRecord.from_json(world.to_json()) == world


@pytest.mark.parametrize("parse", [
    lambda raw: NodeRecord.loads(raw, "/elastic/j/g1/nodes/x"),
    lambda raw: WorldRecord.loads(raw, "/elastic/j/g1/job/world"),
    lambda raw: GenerationRecord.loads(raw, "/elastic/j/generation"),
    lambda raw: EndRecord.loads(raw, "/elastic/j/g1/job/end"),
])
def test_a_pickle_is_refused_with_one_sentence_and_never_unpickled(parse: object) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (pytest.fail, ("the pickle was executed",))

    raw = pickle.dumps(Boom())
    with pytest.raises(RecordError, match=r"^etcd key /elastic/j/\S+ holds a value that is "
                       r"not JSON \(it starts with b'\\x80.*\); only elastic-run may write "
                       r"the job's keys: delete it or use another --job-id\.$"):
        parse(raw)  # type: ignore[operator]


def test_foreign_json_and_bad_fields_are_refused() -> None:
    with pytest.raises(RecordError, match=r"holds a 'something/else' value, not an "
                       r"'elastic-run/world/1' record"):
        WorldRecord.loads(b'{"format": "something/else"}', "w")
    good = node().dumps().replace(b'"agent_pid":7', b'"agent_pid":"7"')
    with pytest.raises(RecordError, match=r"has an invalid 'agent_pid' \('7'\)"):
        NodeRecord.loads(good, "n")
    boolean = node().dumps().replace(b'"agent_pid":7', b'"agent_pid":true')
    with pytest.raises(RecordError, match="invalid 'agent_pid'"):
        NodeRecord.loads(boolean, "n")


def test_parse_nodes_skips_and_reports_bad_records() -> None:
    errors: list[RecordError] = []
    found = parse_nodes([("a", node("a").dumps(), 1), ("b", b"\x80\x04junk", 2),
                         ("c", node("c").dumps(), 3)], on_error=errors.append)
    assert [n.node for n in found] == ["a", "c"]
    assert len(errors) == 1 and "b" in str(errors[0])
