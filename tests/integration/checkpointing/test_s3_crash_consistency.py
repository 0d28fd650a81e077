"""Kills during saves on S3 (moto's server on 127.0.0.1): ``latest`` always names a checkpoint
that verifies (every file at its committed size and CRC32) and loads with that step's values,
or there is none.

S3 commits by another path than local disk: every file is a whole object put under its final
name (no temporary name, no rename), and a save is committed only by ``COMMIT.json``, put after
every shard and ``.metadata`` was listed at its written size. A saver killed at any point must
leave the previous checkpoint or the new one as ``latest``, never a torn one. The savers run in
child processes that the test SIGKILLs, some at random times spread over a whole save, some
right after the first object of the save appears in the bucket (so that every run has kills in
the middle of the writes, however the machine's load stretches a save); moto's server runs in
the test process and outlives them. Seeds are printed (``CKPT_S3_CRASH_SEED`` replays one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

import pytest
import s3fs
import torch

from checkpointing import CheckpointManager
from checkpointing.layout import COMMIT_FILE, LATEST_FILE, format_dir_name, parse_latest
from tests.integration.checkpointing.s3_savers import NUMEL, save_alone, save_as_rank, state
from tests.support.moto_s3 import moto_s3, s3_options

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(300)]

_TIMED_KILLS = 5
_WRITE_KILLS = 3
_RANK_KILLS = 3


# Savers are forked from a fork server (a clean, single-threaded process with torch already
# imported): forking the test process, which runs moto's server threads, could deadlock a
# child, and spawning would import torch again for every kill.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["tests.integration.checkpointing.s3_savers", "s3fs"])


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_s3() as url:
        yield url


class Bucket:
    """What the test reads of the bucket: the objects of a save, and the checks after a kill."""

    def __init__(self, endpoint: str, root: str, ranks: int = 0) -> None:
        self.root = root
        self.options = s3_options(endpoint)
        self.fs = s3fs.S3FileSystem(**self.options, skip_instance_cache=True)
        self.ranks = ranks
        self._reader: CheckpointManager | None = None

    def __enter__(self) -> Bucket:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._reader is not None:
            self._reader.close()

    def objects(self, step: int) -> set[str]:
        """The objects of the save of ``step`` (its attempt directory)."""
        self.fs.invalidate_cache()
        return {p.rsplit("/", 1)[-1]
                for p in self.fs.find(f"{self.root}/{format_dir_name(step, 0)}")}

    def phase(self, step: int) -> str:
        """How far the save of ``step`` got."""
        names = self.objects(step)
        try:
            latest = parse_latest(self.fs.cat_file(f"{self.root}/{LATEST_FILE}"))
        except FileNotFoundError:
            latest = None
        if latest is not None and latest[0] == step:
            return "committed, latest.json written"
        if COMMIT_FILE in names:
            return "committed, latest.json not yet"
        if ".metadata" in names:
            return "shards and .metadata, no commit"
        if names:
            return "some shards, no commit"
        return "nothing written"

    def wait_for_an_object(self, step: int, proc_done: Callable[[], bool]) -> None:
        """Returns once the save of ``step`` has put an object (or its saver ended)."""
        deadline = time.monotonic() + 60
        while not self.objects(step) and not proc_done():
            assert time.monotonic() < deadline, f"the save of step {step} wrote nothing"
            time.sleep(0.005)

    def check_latest(self, allowed: set[int], seed: int) -> int:
        """``latest`` is one of the ``allowed`` steps and loads, verified, with that step's
        values; returns its step."""
        # One reader for every check: it lists and reads afresh each time.
        if self._reader is None:
            self._reader = CheckpointManager(self.root, storage_options=self.options)
        out = {name: torch.empty(NUMEL) for name in state(0, self.ranks)}
        info = self._reader.latest()
        assert info is not None, f"seed={seed}: no checkpoint at all"
        assert info.step in allowed, f"seed={seed}: latest is step {info.step}, not {allowed}"
        # load() verifies what it picks (each file's size and CRC32 against COMMIT.json) and
        # falls back past a damaged one: loading anything but latest means latest was torn.
        loaded = self._reader.load(out)
        assert loaded is not None and loaded.step == info.step, \
            f"seed={seed}: latest (step {info.step}) did not verify; loaded {loaded}"
        expected = state(info.step, self.ranks)
        for name, tensor in out.items():
            assert torch.equal(tensor, expected[name]), f"seed={seed}: {name}, {info.step}"
        return info.step


@pytest.fixture
def bucket(endpoint: str) -> Iterator[Bucket]:
    name = f"crash-{os.urandom(6).hex()}"
    s3fs.S3FileSystem(**s3_options(endpoint)).mkdir(name)
    with Bucket(endpoint, f"s3://{name}/run") as bucket:
        yield bucket


def _kill(proc: BaseProcess) -> None:
    if proc.exitcode is None:
        os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]


def test_killing_the_saver_at_random_points_on_s3_leaves_latest_verified(
    bucket: Bucket,
) -> None:
    seed = int(os.environ.get("CKPT_S3_CRASH_SEED", random.randrange(2**32)))
    print(f"s3 crash seed={seed}")
    rng = random.Random(seed)
    took = _CTX.Value("d", 0.0)

    def save(step: int) -> tuple[BaseProcess, float]:
        saving = _CTX.Event()
        proc = _CTX.Process(target=save_alone,
                            args=(bucket.root, bucket.options, step, saving, took), daemon=True)
        proc.start()
        assert saving.wait(60), "the saver never started its save"
        return proc, time.monotonic()

    # Two undisturbed saves (the first also starts the fork server) measure how long a save
    # takes from its start to the end of its retention pass.
    full = float("inf")
    for step in (1, 2):
        proc, _ = save(step)
        proc.join(60)
        assert proc.exitcode == 0
        full = min(full, took.value)
    # Timed kills: one at a random time in each fifth of 1.2 saves (from staging to past the
    # retention pass). Write kills: at a random time within 0.1 s of the first object put.
    span = full * 1.2
    kills = [("timed", (i + rng.random()) * span / _TIMED_KILLS) for i in range(_TIMED_KILLS)]
    kills += [("write", rng.uniform(0.0, 0.1)) for _ in range(_WRITE_KILLS)]
    rng.shuffle(kills)
    committed, step, phases = 2, 2, Counter[str]()
    for kind, delay in kills:
        step += 1
        proc, started = save(step)
        if kind == "write":
            bucket.wait_for_an_object(step, lambda p=proc: p.exitcode is not None)
            started = time.monotonic()
        time.sleep(max(0.0, started + delay - time.monotonic()))
        _kill(proc)
        proc.join(60)
        phases["finished" if proc.exitcode == 0 else bucket.phase(step)] += 1
        got = bucket.check_latest({committed, step}, seed)
        if proc.exitcode == 0:
            assert got == step, f"seed={seed}: a save that returned is not latest"
        committed = got
    print(f"s3 crash: a save takes {full:.2f} s; outcomes {dict(phases)}")


def test_one_rank_killed_in_a_two_rank_save_on_s3_leaves_latest_verified(
    bucket: Bucket,
) -> None:
    import torch.distributed as dist

    seed = int(os.environ.get("CKPT_S3_CRASH_SEED", random.randrange(2**32)))
    print(f"s3 rank-kill seed={seed}")
    rng = random.Random(seed)
    bucket.ranks = 2

    def save(step: int) -> tuple[list[BaseProcess], Any]:
        # The store lives in the test process, so that either rank may die.
        master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=30))
        saving = _CTX.Event()
        procs = [_CTX.Process(target=save_as_rank,
                              args=(bucket.root, bucket.options, step, rank, master.port, saving),
                              daemon=True) for rank in range(2)]
        for proc in procs:
            proc.start()
        assert saving.wait(90), "the ranks never started their save"
        return procs, master

    procs, master = save(1)
    for proc in procs:
        proc.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    committed, outcomes = bucket.check_latest({1}, seed), []
    # Each save loses one rank, at a random time within 0.1 s of the save's first object put:
    # in the middle of the writes, where the other rank still has shards, .metadata or the
    # commit to write.
    for step in range(2, 2 + _RANK_KILLS):
        procs, master = save(step)
        victim = rng.randrange(2)
        bucket.wait_for_an_object(step, lambda ps=procs: any(p.exitcode is not None
                                                             for p in ps))
        time.sleep(rng.uniform(0.0, 0.1))
        _kill(procs[victim])
        survivor = procs[1 - victim]
        survivor.join(90)
        assert survivor.exitcode is not None, \
            f"seed={seed}: rank {1 - victim} hung after rank {victim} was killed"
        procs[victim].join(10)
        del master
        phase = bucket.phase(step)
        got = bucket.check_latest({committed, step}, seed)
        if survivor.exitcode == 0:
            # A rank that saw its save committed must be right.
            assert got == step, f"seed={seed}: rank {1 - victim} returned, step not latest"
        outcomes.append((victim, phase, survivor.exitcode, got))
        committed = got
    print(f"s3 rank kills: (victim, what the save left, survivor's exit, latest) {outcomes}")
    # Every kill hit a save in its writes: none left its attempt empty.
    assert all(phase != "nothing written" for _, phase, _, _ in outcomes), (seed, outcomes)
