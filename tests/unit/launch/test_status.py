"""Formatting of ``elastic-run status`` output."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from launch.status import format_status, main


@dataclass(frozen=True)
class _Member:
    node_id: str
    host: str
    pid: int
    started_at: float
    auth_token: str = "s3cr3t"


@dataclass(frozen=True)
class _Status:
    round: int
    world_size: int
    members: tuple[_Member, ...]


def test_status_shows_round_world_members_and_ages_but_no_credentials() -> None:
    status = _Status(round=7, world_size=2, members=(
        _Member("b", "10.0.0.2", 22, started_at=990.0), _Member("a", "10.0.0.1", 11, 900.0),
    ))
    text = format_status("job-1", status, now=1000.0)
    lines = text.splitlines()
    assert lines[0] == "job job-1: round 7, world size 2, 2 member(s)"
    assert lines[1] == "  - node_id=a host=10.0.0.1 pid=11 started age=100.0 s"
    assert lines[2] == "  - node_id=b host=10.0.0.2 pid=22 started age=10.0 s"
    assert "s3cr3t" not in text


def test_unknown_job_says_so() -> None:
    assert format_status("nope", None) == (
        "job nope: no rendezvous state found (not started, or expired)."
    )


def test_status_without_endpoints_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASTIC_ETCD_ENDPOINTS", raising=False)
    assert main(["--job-id", "x"]) == 2
    assert "no etcd endpoint given" in capsys.readouterr().err


def test_an_unknown_job_is_an_error_naming_the_job_id(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import launch.status as status

    monkeypatch.setattr(status, "_read", lambda *args: None)
    assert main(["--job-id", "nope", "--etcd", "127.0.0.1:2379"]) == status.EXIT_NOT_FOUND
    err = capsys.readouterr().err
    assert err.startswith("elastic-run: error: job (nope) has no live member in etcd "
                          "(127.0.0.1:2379); check --job-id")


def test_a_round_that_lost_a_member_says_so() -> None:
    status = _Status(round=3, world_size=1, members=(_Member("a", "h", 1, 0.0),))
    text = format_status("j", {**status.__dict__, "expected_size": 2}, now=1.0)
    assert text.splitlines()[0] == (
        "job j: round 3, world size 1 (formed with 2: a node was lost), 1 member(s)"
    )
