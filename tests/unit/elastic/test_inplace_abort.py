"""WorldAbort: a thread makes a world's collectives fail at once (real gloo groups, real
processes), and the NCCL branch's decisions (a stand-in process group, no GPU here)."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from elastic.failures import is_peer_failure_type as is_peer_failure
from elastic.inplace.abort import WorldAbort, WorldAbortedError
from elastic.process_group import NCCL_ASYNC_ERROR_HANDLING_ENV, set_nccl_error_handling
from torch_private import accelerator_backends

_ABORT_AFTER_S = 0.5
#: The groups' and the store's timeout here: what a blocked call would wait without an abort.
_TIMEOUT_S = 60
#: The design: an abort shuts the world's connections down, so a blocked call raises at once
#: (about 0.02 s); without it the call waits for the 60 s timeout. A third of that tells the
#: two apart with room for a loaded 2-core machine.
_AT_ONCE_S = _TIMEOUT_S / 3


def _store_server() -> dist.TCPStore:
    # Hosted by the test process, as a node agent hosts it for its workers.
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=_TIMEOUT_S))


def _abort_later(world_abort: WorldAbort, times: dict[str, float], reason: str) -> None:
    def run() -> None:
        time.sleep(_ABORT_AFTER_S)
        times["abort"] = time.monotonic()
        world_abort.abort(reason)

    threading.Thread(target=run, name="test-watch", daemon=True).start()


def _build(port: int, prefix: str, rank: int, world_size: int) -> WorldAbort:
    """One world as the in-place worker builds it: snapshot, store client, groups."""
    world_abort = WorldAbort(name=prefix)
    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=timedelta(seconds=_TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, client), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=_TIMEOUT_S))
    world_abort.built(dist.group.WORLD)
    return world_abort


def _member_of_a_world_with_a_silent_peer(rank: int, port: int, out: str) -> None:
    from elastic.inplace.groups import abort_groups

    result: dict[str, Any] = {"rank": rank}
    world_abort = _build(port, "e1/", rank, 3)
    dist.all_reduce(torch.ones(4))  # all three are in the world
    if rank == 2:
        time.sleep(60)  # silent: alive, connected, never in the collective again
        return
    times: dict[str, float] = {}
    _abort_later(world_abort, times, "rank 2 is gone")
    try:
        dist.all_reduce(torch.ones(1 << 16))
        result["raised"] = None
    except RuntimeError as exc:
        result["raised"] = f"{type(exc).__name__}: {exc}"[:300]
    result["raised_after_abort_s"] = time.monotonic() - times["abort"]
    result["abort_error_is_a_peer_failure"] = is_peer_failure(
        WorldAbortedError("x")) and world_abort.aborted
    abort_groups(world_abort)
    # The process lives on: a new world over a fresh store prefix, and a few training steps.
    _build(port, "e2/", rank, 2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1).double())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.full((2, 4), float(rank + step), dtype=torch.float64)
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    result["replicas_equal"] = bool(torch.equal(gathered[0], gathered[1]))
    result["trained"] = not torch.equal(flat, torch.zeros_like(flat))
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _spawn(target: Any, args_per_rank: list[tuple[Any, ...]], wait_s: float,
           done: Path, expected: int) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_per_rank]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(list(done.glob("rank*.json"))) < expected:
            time.sleep(0.1)
    finally:
        for p in procs:
            p.join(1)  # the silent peer never exits by itself
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_thread_aborts_a_collective_blocked_on_a_silent_peer_and_the_process_trains_on(
    tmp_path: Path,
) -> None:
    server = _store_server()
    _spawn(_member_of_a_world_with_a_silent_peer,
           [(rank, server.port, str(tmp_path)) for rank in range(3)], 90, tmp_path, 2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["raised"] is not None, f"rank {rank}'s all_reduce did not fail"
        assert "closed" in result["raised"].lower() or "reset" in result["raised"].lower()
        assert result["raised_after_abort_s"] < _AT_ONCE_S, result
        assert result["abort_error_is_a_peer_failure"]
        assert result["replicas_equal"] and result["trained"]


def _member_that_waits_for_a_member_that_never_comes(port: int, out: str) -> None:
    from elastic.inplace.groups import abort_groups

    result: dict[str, Any] = {}
    times: dict[str, float] = {}
    world_abort = WorldAbort(name="e1/")
    client = dist.TCPStore("127.0.0.1", port, is_master=False,
                           timeout=timedelta(seconds=_TIMEOUT_S))
    _abort_later(world_abort, times, "member 1 is gone")
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("e1/", client), rank=0,
                                world_size=2, timeout=timedelta(seconds=_TIMEOUT_S))
        result["raised"] = None
    except RuntimeError as exc:  # DistNetworkError: the store connection was shut down
        result["raised"] = f"{type(exc).__name__}: {exc}"[:300]
    result["raised_after_abort_s"] = time.monotonic() - times["abort"]
    try:
        world_abort.built()
        result["built_refused"] = False
    except WorldAbortedError:
        result["built_refused"] = True
    abort_groups(world_abort)
    _build(port, "e2/", 0, 1)
    total = torch.ones(3)
    dist.all_reduce(total)
    result["new_world_works"] = bool(torch.equal(total, torch.ones(3)))
    dist.destroy_process_group()
    Path(out, "rank0.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_thread_aborts_a_build_blocked_on_a_member_that_never_comes(tmp_path: Path) -> None:
    server = _store_server()
    _spawn(_member_that_waits_for_a_member_that_never_comes, [(server.port, str(tmp_path))],
           90, tmp_path, 1)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["raised"] is not None and "DistNetworkError" in result["raised"], result
    assert result["raised_after_abort_s"] < _AT_ONCE_S, result
    assert result["built_refused"] and result["new_world_works"]


def test_abort_is_idempotent_concurrent_and_harmless_after_the_groups_are_gone() -> None:
    server = _store_server()
    world_abort = _build(server.port, "solo/", 0, 1)
    try:
        assert not world_abort.aborted
        world_abort.check()  # not aborted: no error
        callers = [threading.Thread(target=world_abort.abort, args=(f"reason {i}",))
                   for i in range(4)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(5)
        assert world_abort.aborted and world_abort.reason in {f"reason {i}" for i in range(4)}
        with pytest.raises(WorldAbortedError, match=r"was aborted \(reason \d\)"):
            world_abort.check()
        world_abort.abort("again")  # a no-op
        assert world_abort.reason != "again"
    finally:
        world_abort.release()
        dist.destroy_process_group()
    world_abort.abort("after the groups are gone")  # nothing to touch, no error


def test_abort_during_release_and_destroy_waits_or_does_nothing() -> None:
    server = _store_server()
    world_abort = _build(server.port, "race/", 0, 1)
    from elastic.inplace.groups import abort_groups

    started = threading.Event()

    def watch() -> None:
        started.set()
        world_abort.abort("member gone while the owner destroys the world")

    thread = threading.Thread(target=watch)
    thread.start()
    started.wait(5)
    abort_groups(world_abort)  # releases (waiting for an abort in progress), then destroys
    thread.join(5)
    assert not thread.is_alive() and world_abort.aborted and not dist.is_initialized()


def test_only_sockets_opened_since_the_snapshot_and_not_excluded_are_shut_down() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    old = socket.create_connection(listener.getsockname())
    old_served, _ = listener.accept()
    skip: set[int] = set()  # consulted at abort time, so the owner may fill it later
    keeps_channel, severs_all = WorldAbort(skip_fds=skip), WorldAbort()
    late_listener = socket.socket()  # a listener opened in the window: never shut down
    late_listener.bind(("127.0.0.1", 0))
    late_listener.listen(8)
    channel = socket.create_connection(listener.getsockname())  # e.g. a link to the agent
    channel_served, _ = listener.accept()
    skip.update({channel.fileno(), channel_served.fileno()})
    ours = socket.create_connection(late_listener.getsockname())
    ours_served, _ = late_listener.accept()
    opened = (listener, old, old_served, late_listener, channel, channel_served, ours,
              ours_served)
    try:
        keeps_channel.abort("x")
        ours_served.settimeout(2)
        assert ours_served.recv(1) == b""  # shut down
        channel.sendall(b"c")
        assert channel_served.recv(1) == b"c"  # excluded
        severs_all.abort("y")
        channel_served.settimeout(2)
        assert channel_served.recv(1) == b""
        old.sendall(b"o")
        assert old_served.recv(1) == b"o"  # older than the snapshot
        with socket.create_connection(late_listener.getsockname()):
            pass  # still listening
    finally:
        for s in opened:
            s.close()


# -- the NCCL branch, with stand-ins for the process group and its backends --------------------


class _Backend:
    def __init__(self, name: str, calls: list[tuple[str, str, int]]) -> None:
        self._name = name
        self.calls = calls

    def name(self) -> str:
        return self._name

    def abort(self) -> None:
        self.calls.append(("abort", self._name, threading.get_ident()))

    def _group_start(self) -> None:
        self.calls.append(("group_start", self._name, threading.get_ident()))

    def _group_end(self) -> None:
        self.calls.append(("group_end", self._name, threading.get_ident()))


class _Group:
    """A ProcessGroup with a gloo backend for CPU and ``accel`` for CUDA."""

    def __init__(self, accel: _Backend | None, gloo: _Backend) -> None:
        self._backends = {"cpu": gloo, **({"cuda": accel} if accel else {})}
        self._device_types = [torch.device(d) for d in self._backends]

    def _get_backend(self, device: torch.device) -> _Backend:
        if device.type not in self._backends:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return self._backends[device.type]


@pytest.fixture
def no_destroy() -> Any:
    boom = mock.Mock(side_effect=AssertionError("abort must not destroy or unregister groups"))
    with mock.patch.object(dist, "destroy_process_group", boom), \
            mock.patch.object(dist.distributed_c10d, "_abort_process_group", boom), \
            mock.patch.object(dist.distributed_c10d, "destroy_process_group", boom):
        yield boom


def test_nccl_communicators_are_aborted_from_the_calling_thread_and_never_destroyed(
    no_destroy: Any,
) -> None:
    calls: list[tuple[str, str, int]] = []
    nccl, gloo = _Backend("nccl", calls), _Backend("gloo", calls)
    world_abort = WorldAbort(name="e3")
    world_abort.built(_Group(nccl, gloo), _Group(None, gloo))  # default + checkpoint group
    thread = threading.Thread(target=world_abort.abort, args=("member 2 is gone",))
    thread.start()
    thread.join(5)
    assert calls == [("abort", "nccl", thread.ident)]  # once, from the watch thread; never gloo
    world_abort.abort("twice")
    assert len(calls) == 1
    no_destroy.assert_not_called()


def test_several_nccl_communicators_are_aborted_inside_one_nccl_group(no_destroy: Any) -> None:
    calls: list[tuple[str, str, int]] = []
    first, second = _Backend("nccl", calls), _Backend("nccl", calls)
    gloo = _Backend("gloo", calls)
    world_abort = WorldAbort()
    world_abort.built(_Group(first, gloo), _Group(second, gloo))
    world_abort.abort("gone")
    assert [c[0] for c in calls] == ["group_start", "abort", "abort", "group_end"]
    assert {c[2] for c in calls} == {threading.get_ident()}


def test_a_released_world_is_never_touched_and_an_aborted_build_is_refused(
    no_destroy: Any,
) -> None:
    calls: list[tuple[str, str, int]] = []
    released = WorldAbort()
    released.built(_Group(_Backend("nccl", calls), _Backend("gloo", calls)))
    released.release()
    released.abort("after release")
    assert calls == [] and released.aborted
    during_build = WorldAbort(name="e5")
    during_build.abort("member gone during the build")
    with pytest.raises(WorldAbortedError, match=r"world e5 was aborted while it was built"):
        during_build.built(_Group(_Backend("nccl", calls), _Backend("gloo", calls)))
    assert [c[:2] for c in calls] == [("abort", "nccl")]  # the communicator it built meanwhile


def test_accelerator_backends_of_a_real_gloo_group_are_none() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert accelerator_backends(dist.group.WORLD) == []
    finally:
        dist.destroy_process_group()


def test_in_place_workers_force_nccl_error_handling_off_and_restart_mode_keeps_the_users(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv(NCCL_ASYNC_ERROR_HANDLING_ENV, raising=False)
    set_nccl_error_handling(in_place=False)
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING_ENV] == "3"
    monkeypatch.setenv(NCCL_ASYNC_ERROR_HANDLING_ENV, "1")
    set_nccl_error_handling(in_place=False)
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING_ENV] == "1"
    with caplog.at_level(logging.WARNING):
        set_nccl_error_handling(in_place=True)
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING_ENV] == "0"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 ignored" in caplog.text


@pytest.mark.parametrize(("mode", "expected"), [("restart", "3"), ("auto", "0"),
                                                ("inplace", "0"), (None, "0")])
def test_under_elastic_run_only_restart_mode_keeps_torchs_nccl_error_handling(
    monkeypatch: pytest.MonkeyPatch, mode: str | None, expected: str,
) -> None:
    # auto must use 0 from the first build: a world is upgraded to in place without a rebuild.
    from elastic import env
    from elastic.inplace.groups import nccl_handling_in_place

    monkeypatch.delenv(NCCL_ASYNC_ERROR_HANDLING_ENV, raising=False)
    if mode is None:
        monkeypatch.delenv(env.MODE, raising=False)
    else:
        monkeypatch.setenv(env.MODE, mode)
    set_nccl_error_handling(in_place=nccl_handling_in_place())
    assert os.environ[NCCL_ASYNC_ERROR_HANDLING_ENV] == expected


@pytest.mark.parametrize(("mode", "expected"), [("restart", "3"), ("auto", "0"),
                                                ("inplace", "0")])
def test_a_worlds_nccl_groups_get_the_error_handling_of_the_elastic_mode(
    monkeypatch: pytest.MonkeyPatch, mode: str, expected: str,
) -> None:
    from elastic import env
    from elastic.inplace import groups

    class Built(Exception):
        pass

    seen: list[str | None] = []

    def init_process_group(*_args: Any, **_kwargs: Any) -> None:
        seen.append(os.environ.get(NCCL_ASYNC_ERROR_HANDLING_ENV))
        raise Built  # no GPU here: what matters is the variable the group would read

    monkeypatch.delenv(NCCL_ASYNC_ERROR_HANDLING_ENV, raising=False)
    monkeypatch.setenv(env.MODE, mode)
    monkeypatch.setattr(groups.dist, "init_process_group", init_process_group)
    with pytest.raises(Built):
        groups.build_groups("nccl", store=dist.HashStore(), epoch=1, rank=0, world_size=1,
                            device=torch.device("cpu"), timeout=timedelta(seconds=5))
    assert seen == [expected]


def _member_of_a_group_built_after_the_world(rank: int, port: int, out: str) -> None:
    from elastic.inplace.groups import abort_groups
    from torch_private import socket_inodes

    result: dict[str, Any] = {"rank": rank}
    world_abort = _build(port, "e1/", rank, 3)
    before = socket_inodes()
    later = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # a mesh's, say
    world_abort.adopt(before, later)
    dist.all_reduce(torch.ones(4), group=later)  # all three are in it
    if rank == 2:
        time.sleep(60)  # silent: alive, connected, never in the collective again
        return
    times: dict[str, float] = {}
    _abort_later(world_abort, times, "rank 2 is gone")
    try:
        dist.all_reduce(torch.ones(1 << 16), group=later)
        result["raised"] = None
    except RuntimeError as exc:
        result["raised"] = f"{type(exc).__name__}: {exc}"[:300]
    result["raised_after_abort_s"] = time.monotonic() - times["abort"]
    abort_groups(world_abort)
    try:
        world_abort.adopt(socket_inodes())
        result["adopt_refused"] = False
    except WorldAbortedError:
        result["adopt_refused"] = True
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_groups_adopted_after_the_build_are_aborted_with_the_world(tmp_path: Path) -> None:
    server = _store_server()
    _spawn(_member_of_a_group_built_after_the_world,
           [(rank, server.port, str(tmp_path)) for rank in range(3)], 90, tmp_path, 2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["raised"] is not None, f"rank {rank}'s all_reduce did not fail"
        assert result["raised_after_abort_s"] < 2.0, result
        assert result["adopt_refused"], result
