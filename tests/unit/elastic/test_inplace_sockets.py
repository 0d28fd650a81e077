"""Severing a world's gloo sockets frees a peer blocked on this process (real gloo groups)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest

from torch_private import WorldSockets, socket_inodes

_WAIT_S = 30.0


def _member(rank: int, port: int, root: str, sever: bool, wait_s: float) -> None:
    import torch
    import torch.distributed as dist

    marks = Path(root)
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=timedelta(seconds=30))
    before = socket_inodes()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=60))
    noted = WorldSockets(before, socket_inodes(), skip_ports={port})
    dist.all_reduce(torch.ones(2))
    if rank == 2:  # the peer that dies
        os._exit(0)
    if rank == 1:  # blocked on rank 0, the survivor that abandons the world
        try:
            dist.recv(torch.zeros(2), src=0)
        except RuntimeError as exc:
            (marks / "rank1-failed").write_text(str(exc))
        return
    # rank 0 keeps a reference to its group (as a DDP in a training script's frame does), so
    # destroying it would not close its connections; it abandons the world and waits, alive.
    group = dist.group.WORLD
    assert group is not None
    time.sleep(0.5)
    severed = noted.sever() if sever else 0
    (marks / "rank0-severed").write_text(str(severed))
    deadline = time.monotonic() + wait_s
    while not (marks / "rank1-failed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (marks / "rank0-saw-rank1-fail").write_text(str((marks / "rank1-failed").exists()))


def _run(tmp_path: Path, sever: bool, wait_s: float = _WAIT_S) -> Path:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_member, args=(r, port, str(tmp_path), sever, wait_s))
             for r in range(3)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=wait_s + 60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return tmp_path


@pytest.mark.timeout(180)
def test_severing_frees_a_peer_blocked_on_a_survivor_that_still_holds_its_group(
    tmp_path: Path,
) -> None:
    marks = _run(tmp_path, sever=True)
    assert int((marks / "rank0-severed").read_text()) >= 1  # at least the one to rank 1
    assert (marks / "rank0-saw-rank1-fail").read_text() == "True", "rank 1 stayed blocked"
    assert "closed" in (marks / "rank1-failed").read_text().lower()


@pytest.mark.timeout(180)
def test_without_severing_the_peer_stays_blocked_while_the_survivor_lives(
    tmp_path: Path,
) -> None:
    # Why severing exists: torch's destroy/abort leave the connections open while referenced.
    marks = _run(tmp_path, sever=False, wait_s=5.0)
    assert (marks / "rank0-saw-rank1-fail").read_text() == "False"


def test_a_noted_socket_closed_since_is_left_alone() -> None:
    before = socket_inodes()
    a, b = socket.socketpair(socket.AF_UNIX)  # not TCP: never noted
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    noted = WorldSockets(before, socket_inodes())
    assert len(noted) == 2  # both ends of the TCP connection; never the listener
    client.close()
    served.close()
    reused = socket.socket()  # may take a freed fd number: a different socket
    try:
        assert noted.sever() == 0
        reused.bind(("127.0.0.1", 0))
        reused.listen(1)  # still usable: it was not shut down
    finally:
        reused.close()
        listener.close()
        a.close()
        b.close()
