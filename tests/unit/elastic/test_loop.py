"""ElasticLoop control flow in one process: resume, saves, drain, bad input."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from checkpointing import CheckpointInfo, CheckpointManager, ModelOptimizerState, SaveHandle
from elastic.errors import ConfigError
from elastic.loop import ElasticLoop
from elastic.sampler import ElasticSampler

DATASET = 40


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(DATASET, 4, generator=generator, dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True), torch.arange(DATASET))


class Job:
    """A tiny float64 regression trained through the loop."""

    def __init__(self, root: Path, *, width: int = 4, global_batch: int = 8) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1)).double()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 3, gamma=0.5)
        self.sampler = ElasticSampler(DATASET, seed=5, rank=0, world_size=1)
        self.manager = CheckpointManager(str(root), async_mode="disabled")
        self.global_batch = global_batch
        self.trained: dict[int, list[int]] = {}

    def loop(self, max_steps: int, **kwargs: object) -> ElasticLoop:
        return ElasticLoop(
            None,
            state={"train": ModelOptimizerState(self.model, self.optimizer),
                   "scheduler": self.scheduler},
            checkpoint=self.manager, sampler=self.sampler, max_steps=max_steps,
            checkpoint_interval=3, global_batch_size=self.global_batch, micro_batch_size=4,
            **kwargs,  # type: ignore[arg-type]
        )

    def train(self, max_steps: int, *, stop_after: int | None = None) -> ElasticLoop:
        with self.loop(max_steps) as loop:
            loader = DataLoader(data(), batch_size=loop.micro_batch_size, sampler=self.sampler)
            for step in loop:
                ids: list[int] = []
                for x, y, index in loop.micro_batches(loader, self.model):
                    loop.scale_loss(nn.functional.mse_loss(self.model(x), y)).backward()
                    ids.extend(index.tolist())
                self.optimizer.step()
                self.optimizer.zero_grad()
                self.scheduler.step()
                self.trained[step] = ids
                if stop_after is not None and step == stop_after:
                    break  # a crash: end_step never runs, nothing after the last save counts
                loop.end_step()
        return loop


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_a_crashed_and_resumed_run_ends_with_the_weights_of_an_undisturbed_run(
    tmp_path: Path,
) -> None:
    steady = Job(tmp_path / "steady")
    steady.train(10)
    first = Job(tmp_path / "crashy")
    first.train(10, stop_after=7)
    second = Job(tmp_path / "crashy")
    loop = second.train(10)
    assert loop.resumed_from == 6  # the last multiple of checkpoint_interval before the crash
    assert loop.step == 10 and loop.finished
    for a, b in zip(weights(steady.model), weights(second.model), strict=True):
        assert torch.equal(a, b)
    assert second.scheduler.state_dict() == steady.scheduler.state_dict()
    assert {**first.trained, **second.trained} == steady.trained


def test_a_resume_continues_at_step_times_global_batch_of_the_sample_stream(
    tmp_path: Path,
) -> None:
    Job(tmp_path).train(6)
    job = Job(tmp_path)
    with job.loop(10) as loop:
        assert loop.step == 6
        assert (job.sampler.epoch, job.sampler.consumed) == divmod(6 * 8, DATASET)


def test_saves_happen_every_interval_and_at_the_last_step(tmp_path: Path) -> None:
    Job(tmp_path).train(7)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert [int(n[5:15]) for n in names] == [3, 6, 7]


def test_a_checkpoint_of_a_different_model_is_refused_and_left_untouched(tmp_path: Path) -> None:
    Job(tmp_path).train(3)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=r"^the newest checkpoint in \(.*\) does not fit this "
                       r"job's model or state \(.*\); point the checkpoint URL at a new "
                       r"directory or restore the code that wrote it\.$"):
        Job(tmp_path, width=5).train(6)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_a_changed_global_batch_is_refused(tmp_path: Path) -> None:
    Job(tmp_path).train(3)
    with pytest.raises(ConfigError, match=r"global batch size \(8\) but this run asks for \(4\)"):
        Job(tmp_path, global_batch=4).train(6)


def test_sigterm_stops_at_the_step_boundary_with_a_final_checkpoint(tmp_path: Path) -> None:
    job = Job(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    with job.loop(20) as loop:
        loader = DataLoader(data(), batch_size=loop.micro_batch_size, sampler=job.sampler)
        for step in loop:
            for x, y, _ in loop.micro_batches(loader):
                loop.scale_loss(nn.functional.mse_loss(job.model(x), y)).backward()
            job.optimizer.step()
            job.optimizer.zero_grad()
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            loop.end_step()
    assert loop.drained and not loop.finished and loop.step == 5
    info = CheckpointManager(str(tmp_path)).latest()
    assert info is not None and info.step == 5
    assert signal.getsignal(signal.SIGTERM) == previous  # the loop's handler is gone


def test_sigterm_to_the_whole_process_group_drains_despite_dataloader_workers(
    tmp_path: Path,
) -> None:
    # torchrun's agent signals the worker's process group: DataLoader workers get SIGTERM
    # too, and torch makes that fatal to them unless the loop shields them.
    job = Job(tmp_path)
    with job.loop(20) as loop:
        loader = DataLoader(data(), batch_size=loop.micro_batch_size, sampler=job.sampler,
                            num_workers=1)
        for step in loop:
            for x, y, _ in loop.micro_batches(loader):
                loop.scale_loss(nn.functional.mse_loss(job.model(x), y)).backward()
            job.optimizer.step()
            job.optimizer.zero_grad()
            if step == 2:
                workers = multiprocessing.active_children()
                assert workers
                for worker in workers:
                    os.kill(worker.pid, signal.SIGTERM)  # type: ignore[arg-type]
                os.kill(os.getpid(), signal.SIGTERM)
                workers[0].join(timeout=1.0)
                assert all(worker.is_alive() for worker in workers)
            loop.end_step()
    assert loop.drained and loop.step == 3
    info = CheckpointManager(str(tmp_path)).latest()
    assert info is not None and info.step == 3


def test_a_step_without_end_step_is_an_error(tmp_path: Path) -> None:
    job = Job(tmp_path)
    loop = job.loop(3)
    with pytest.raises(RuntimeError, match=r"^step \(0\) ended without loop\.end_step\(\)"):
        for _ in loop:
            pass
    loop.close()


def test_a_loader_whose_batch_is_not_the_micro_batch_is_refused(tmp_path: Path) -> None:
    job = Job(tmp_path)
    with job.loop(3) as loop:
        loader = DataLoader(data(), batch_size=5, sampler=job.sampler)
        with pytest.raises(ConfigError, match=r"^DataLoader batch_size \(5\) differs"):
            next(loop.micro_batches(loader))


def test_all_but_the_last_micro_batch_skip_the_gradient_all_reduce(tmp_path: Path) -> None:
    syncs: list[bool] = []

    class Recorder(nn.Module):
        @contextmanager
        def no_sync(self) -> Iterator[None]:
            syncs.append(False)
            yield

    job = Job(tmp_path, global_batch=16)
    with job.loop(1) as loop:
        loader = DataLoader(data(), batch_size=loop.micro_batch_size, sampler=job.sampler)
        assert loop.grad_accum_steps == 4 and loop.loss_scale == 0.25
        for _ in loop.micro_batches(loader, Recorder()):
            syncs.append(True)
    assert syncs == [False, True, False, True, False, True, True]


class LazyCommitManager:
    """A checkpoint manager whose saves commit only when someone waits for them.

    ``waits`` records ``(save step, loop step at the wait)``: the latest point at which each
    save was known to be committed, which is what bounds the work a failure loses.
    """

    def __init__(self) -> None:
        self.waits: list[tuple[int, int]] = []
        self.loop: ElasticLoop | None = None
        self.storage = type("S", (), {"url": "memory://"})()

    def load(self, state: object) -> None:
        return None

    def save(self, step: int, state: object) -> SaveHandle:
        manager = self

        class LazyCommit(Future[CheckpointInfo]):
            def exception(self, timeout: float | None = None) -> BaseException | None:
                self._commit()
                return super().exception(timeout)

            def result(self, timeout: float | None = None) -> CheckpointInfo:
                self._commit()
                return super().result(timeout)

            def _commit(self) -> None:
                if not super().done():
                    assert manager.loop is not None
                    manager.waits.append((step, manager.loop.step))
                    self.set_result(CheckpointInfo(step, "memory://", 1, 0, 0.0, 1))

        staged: Future[None] = Future()
        staged.set_result(None)
        return SaveHandle(step=step, staged=staged, committed=LazyCommit())

    def close(self, wait: bool = True) -> None:
        pass


@pytest.mark.parametrize(
    ("lag", "waits"),
    [
        (0, [(3, 3), (6, 6), (9, 9), (10, 10)]),
        (1, [(3, 4), (6, 7), (9, 10), (10, 10)]),
        (None, [(3, 6), (6, 9), (10, 10)]),  # the interval: each save before the next one
    ],
)
def test_each_save_is_committed_at_most_max_commit_lag_steps_after_it_started(
    lag: int | None, waits: list[tuple[int, int]]
) -> None:
    manager = LazyCommitManager()
    loop = ElasticLoop(
        None, state={}, checkpoint=manager, sampler=None,  # type: ignore[arg-type]
        max_steps=10, checkpoint_interval=3, global_batch_size=4, max_commit_lag=lag,
        install_signal_handler=False,
    )
    manager.loop = loop
    with loop:
        for _ in loop:
            loop.end_step()
    assert manager.waits == waits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_steps": -1}, r"^max_steps \(-1\) must be non-negative\.$"),
        ({"checkpoint_interval": 0}, r"^checkpoint_interval \(0\) must be at least 1\.$"),
        ({"global_batch_size": 0}, r"^global_batch_size \(0\) must be a positive integer\.$"),
        ({"max_commit_lag": 2}, r"^max_commit_lag \(2\) must be between 0 and "
         r"checkpoint_interval \(1\); pass None for the interval\.$"),
        ({"max_commit_lag": -1}, r"^max_commit_lag \(-1\) must be between 0"),
    ],
)
def test_invalid_loop_settings_are_one_sentence_config_errors(
    tmp_path: Path, kwargs: dict[str, int], message: str
) -> None:
    settings = {"max_steps": 3, "checkpoint_interval": 1, "global_batch_size": 8, **kwargs}
    with pytest.raises(ConfigError, match=message):
        ElasticLoop(None, state={}, checkpoint=None, sampler=None, **settings)
