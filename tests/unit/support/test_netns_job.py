"""The namespace job harness's pure parts: the stall measurement, sockets, commit records."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest

from tests.integration.training.inplace_audit import Audit
from tests.support.netns_job import Fault, commits, environ_of, stall, tcp_sockets


def _audit(*done: tuple[int, int, int, float]) -> Audit:
    """``done`` records as (pid, gen, step, t)."""
    return Audit(gens=[], batches=[], setups=[],
                 done=[{"kind": "done", "pid": p, "gen": g, "step": s, "t": t}
                       for p, g, s, t in done])


FAULT = Fault("silent host", "n2", t=100.0, gen=3, hit=frozenset({9}),
              survivors=frozenset({1, 2}))


def test_the_stall_ends_when_every_survivor_completed_a_step_of_a_newer_world() -> None:
    audit = _audit(
        (1, 3, 10, 99.9), (2, 3, 10, 99.9),  # before the fault
        (1, 3, 11, 100.1), (2, 3, 11, 100.1),  # the step in flight, done in the old world
        (9, 3, 11, 100.1),
        (1, 4, 11, 103.2), (2, 4, 11, 103.5), (1, 4, 12, 103.6),
    )
    assert stall(audit, FAULT) == pytest.approx(3.5)


def test_a_survivor_that_never_went_on_makes_the_stall_infinite() -> None:
    assert math.isinf(stall(_audit((1, 4, 11, 103.2)), FAULT))
    with pytest.raises(ValueError, match="no survivors"):
        stall(_audit(), Fault("x", "n0", 1.0, 0, frozenset({1}), frozenset()))


def test_after_a_restart_the_first_step_of_a_new_process_ends_the_stall() -> None:
    # torchrun: every generation is 0 and the survivors are new processes.
    fault = Fault("silent host", "n2", t=100.0, gen=0, hit=frozenset({9}),
                  survivors=frozenset({1, 2}))
    audit = _audit((1, 0, 11, 100.1), (2, 0, 11, 100.1),  # in flight, old processes
                   (5, 0, 5, 161.0), (6, 0, 5, 161.2))
    assert stall(audit, fault, restarted=True) == pytest.approx(61.0)


def test_a_process_sees_its_own_listening_socket_and_environment(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        mine = tcp_sockets(os.getpid())
        assert any(s.local == ("127.0.0.1", port) and s.state == "LISTEN" for s in mine)
    assert environ_of(os.getpid()).get("PATH") == os.environ.get("PATH")


def test_commit_records_are_read_oldest_first(tmp_path: Path) -> None:
    for name, created in (("step-0000000010_r0002", 20.0), ("step-0000000005_r0001", 10.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "COMMIT.json").write_text(json.dumps(
            {"step": int(name[5:15]), "round": int(name[-4:]), "created_at": created}))
    (tmp_path / "step-0000000015_r0002").mkdir()  # not committed
    found = commits(tmp_path)
    assert [(c["dir"], c["round"]) for c in found] == [("step-0000000005_r0001", 1),
                                                       ("step-0000000010_r0002", 2)]
