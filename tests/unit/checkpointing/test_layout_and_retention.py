from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checkpointing.errors import CheckpointCorruptError, CheckpointFormatError
from checkpointing.layout import (
    CommitRecord,
    FileEntry,
    format_dir_name,
    format_latest,
    parse_dir_name,
    parse_latest,
)
from checkpointing.retention import plan_retention


def test_dir_name_round_trips_step_and_round() -> None:
    name = format_dir_name(42, 3)
    assert name == "step-0000000042_r0003"
    assert parse_dir_name(name) == (42, 3)
    assert parse_dir_name("s3://b/p/" + name + "/") == (42, 3)


@pytest.mark.parametrize("name", ["latest.json", "step-42_r3", "step-0000000042_r0003x", ""])
def test_foreign_names_are_not_attempt_dirs(name: str) -> None:
    assert parse_dir_name(name) is None


def test_out_of_range_step_is_rejected_with_the_value() -> None:
    with pytest.raises(ValueError, match=r"^Checkpoint step \(-1\) must be between"):
        format_dir_name(-1, 0)


def test_commit_record_round_trips_through_json() -> None:
    rec = CommitRecord(
        step=7,
        round=1,
        world_size=2,
        run_id="r",
        created_at=1.5,
        files={"a/b": FileEntry(size=3, crc32=99)},
        metadata={"k": 1},
    )
    assert CommitRecord.from_json(rec.to_json(), where="x") == rec


def test_commit_record_of_another_format_version_is_refused_naming_it() -> None:
    data = b'{"format_version": 99, "step": 1}'
    pattern = r"^Commit record \(x/COMMIT.json\) has format version \(99\)"
    with pytest.raises(CheckpointFormatError, match=pattern):
        CommitRecord.from_json(data, where="x/COMMIT.json")


def test_garbage_commit_record_is_reported_corrupt() -> None:
    pattern = "^" + re.escape("Commit record (p) is not valid JSON")
    with pytest.raises(CheckpointCorruptError, match=pattern):
        CommitRecord.from_json(b"{nope", where="p")


def test_latest_pointer_round_trips_and_rejects_garbage() -> None:
    assert parse_latest(format_latest(5, format_dir_name(5, 0))) == (5, "step-0000000005_r0000")
    assert parse_latest(b"[]") is None
    assert parse_latest(b'{"step": 1, "dir": "../evil"}') is None


def test_keep_last_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"^keep_last \(0\) must be at least 1"):
        plan_retention([], [], keep_last=0)


def test_retention_keeps_last_n_and_clears_old_leftovers() -> None:
    c = [format_dir_name(s, 0) for s in (10, 20, 30, 40)]
    u = [format_dir_name(15, 0), format_dir_name(50, 0)]
    got = plan_retention(c, u, keep_last=2, in_flight=format_dir_name(50, 0))
    assert got == [format_dir_name(10, 0), format_dir_name(15, 0), format_dir_name(20, 0)]


def test_retention_keeps_every_kth_step_for_good() -> None:
    c = [format_dir_name(s, 0) for s in (10, 20, 30, 40)]
    assert plan_retention(c, [], keep_last=1, keep_every=20) == [
        format_dir_name(10, 0),
        format_dir_name(30, 0),
    ]


_names = st.builds(format_dir_name, st.integers(0, 50), st.integers(0, 3))


@given(
    committed=st.sets(_names, max_size=12),
    uncommitted=st.sets(_names, max_size=12),
    keep_last=st.integers(1, 5),
    in_flight=st.one_of(st.none(), _names),
    keep_every=st.one_of(st.none(), st.integers(1, 10)),
)
def test_retention_never_deletes_newest_committed_or_in_flight(
    committed: set[str],
    uncommitted: set[str],
    keep_last: int,
    in_flight: str | None,
    keep_every: int | None,
) -> None:
    doomed = plan_retention(
        committed, uncommitted, keep_last=keep_last, in_flight=in_flight, keep_every=keep_every
    )
    key = parse_dir_name
    if committed:
        newest = max(committed, key=lambda n: key(n) or (0, 0))
        assert newest not in doomed
        kept = committed - set(doomed)
        assert len(kept) >= min(keep_last, len(committed))
    else:
        assert doomed == []
    assert in_flight not in doomed
    assert set(doomed) <= committed | uncommitted
