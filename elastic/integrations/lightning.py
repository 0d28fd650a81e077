"""elastic-run for Lightning scripts (the ``lightning`` extra).

Five lines of a Lightning script change::

    from elastic.integrations.lightning import ElasticLightning
    elastic = ElasticLightning("s3://bucket/runs/exp-1", global_batch_size=256,
                               checkpoint_every=100)
    loader = elastic.dataloader(dataset, num_workers=4)          # was DataLoader(...)
    trainer = L.Trainer(**elastic.trainer_kwargs(max_steps=10_000))
    trainer.fit(model, loader, ckpt_path=elastic.resume_path())

and the script then, under ``elastic-run`` (or torchrun, or alone):

* **resumes** from the newest committed checkpoint in ``checkpoint_dir``: Lightning's own
  ``.ckpt`` files, which :class:`ElasticCallback` writes every ``checkpoint_every`` steps, at
  the last step and on a drain, and commits (:mod:`~elastic.integrations._commits`) once the
  file is durable. Rank 0 chooses it and every rank loads that one;
* **drains**: a SIGTERM (the agent's, on a preemption notice or a world change) becomes a
  final checkpoint at a step boundary every rank agrees on, then the worker tells its agent it
  drained and exits 143 (a stop, not a failure; the preempted node's agent exits 0).
  Lightning's own SIGTERM handling is switched off: it stops only the signalled rank, without
  a checkpoint, with exit code 0, which a launcher takes for "finished";
* **reports** steps, checkpoint times and restores to the agent (``elastic-run goodput``,
  ``--metrics-port``);
* keeps the **global batch** fixed and the data order **exactly once** at any world size:
  the loader yields this rank's share of each step in ``accumulate_grad_batches``
  micro-batches (:mod:`~elastic.integrations._data`), and :class:`FixedBatchDDPStrategy`
  scales each micro-batch's loss so that the gradient is the mean over the global batch.

Lightning counts gradient accumulation in micro-batches since its epoch began, and keeps that
count in its checkpoints, so the number of micro-batches per step is fixed for the job (a
resumed job with another count would step at the wrong batch): a rank's micro-batches grow as
the world shrinks; size ``accumulate_grad_batches`` for the smallest world. The training is
one endless Lightning epoch (``max_steps`` ends it). ``docs/frameworks.md`` lists the rest.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

from elastic.integrations._commits import CommitLog, Committed
from elastic.integrations._data import StepBatches, even_split
from elastic.integrations._drain import DRAINED_EXIT_CODE, DrainAgreement, Drained
from elastic.integrations._reporting import Reporter
from elastic.integrations._world import (
    GROUP_TIMEOUT,
    WorkerWorld,
    agree,
    join_default_group,
    world_from_env,
)
from elastic.loop.signals import shield_workers_from_sigterm
from elastic_errors import ConfigError

__all__ = ["DRAINED_EXIT_CODE", "Drained", "ElasticCallback", "ElasticLightning",
           "FixedBatchDDPStrategy"]

logger = logging.getLogger(__name__)

_NAME = "step-{step:09d}.ckpt"
_STEP = re.compile(r"step-(\d{9})\.ckpt")


class FixedBatchDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with a fixed global batch at any world size.

    Each micro-batch's loss is multiplied by its factor (:meth:`StepBatches.loss_factor`)
    before the backward pass, so that uneven shares (3 ranks and a global batch of 10) still
    give the mean gradient over the global batch. The process group is Lightning's own (it
    keeps the one :class:`ElasticLightning` built).

    Args:
        elastic: The job's :class:`ElasticLightning`.
        kwargs: Passed to ``DDPStrategy``.
    """

    def __init__(self, elastic: ElasticLightning, **kwargs: Any) -> None:
        kwargs.setdefault("timeout", GROUP_TIMEOUT)
        super().__init__(**kwargs)
        self._elastic = elastic
        self._micro_index = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Notes which micro-batch of its step ``batch`` is (Lightning's batch index)."""
        super().on_train_batch_start(batch, batch_idx)
        self._micro_index = batch_idx

    def backward(self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        """Scales the micro-batch's loss for the global batch, then runs Lightning's
        backward."""
        stream = self._elastic.stream
        if stream is not None:
            closure_loss = closure_loss * stream.loss_factor(self._micro_index)
        return super().backward(closure_loss, optimizer, *args, **kwargs)


class ElasticCallback(Callback):
    """Saves, commits, resumes, drains and reports (see the module docstring).

    Made by :class:`ElasticLightning`; add it with ``trainer_kwargs()``.
    """

    def __init__(self, elastic: ElasticLightning) -> None:
        self._elastic = elastic
        self._setup_at: float | None = None
        self._resumed_step: int | None = None
        self._last_step = -1
        self._step_started: float | None = None
        self._installed = False

    @property
    def state_key(self) -> str:
        """One state per job (the class name)."""
        return "ElasticCallback"

    # -- state in Lightning's checkpoint ----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The data cursor (the step) and what it means (the global batch, the order)."""
        stream = self._elastic.stream
        return {"format": 1, "global_batch_size": self._elastic.global_batch_size,
                "accumulation": self._elastic.accumulate_grad_batches,
                "step": stream.step if stream is not None else None,
                "order": stream.sampler.state_dict() if stream is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Puts the data cursor where the checkpoint's step ends.

        Raises:
            ConfigError: If the checkpoint was trained with another global batch,
                accumulation or data order.
        """
        elastic = self._elastic
        for key, mine in (("global_batch_size", elastic.global_batch_size),
                          ("accumulation", elastic.accumulate_grad_batches)):
            if state_dict.get(key) != mine:
                raise ConfigError(
                    f"the checkpoint was trained with {key} ({state_dict.get(key)}) but this "
                    f"job asks for ({mine}); keep them fixed for a job or start it in a new "
                    "checkpoint directory."
                )
        stream, step = elastic.stream, state_dict.get("step")
        if stream is not None and isinstance(step, int):
            saved = state_dict.get("order")
            if isinstance(saved, dict):
                stream.sampler.load_state_dict(saved)  # refuses another order, with a reason
            stream.seek(step)
        self._resumed_step = step if isinstance(step, int) else None

    # -- hooks ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Checks the trainer's configuration; switches Lightning's SIGTERM handling off."""
        if stage != "fit":
            return
        self._setup_at = time.monotonic()
        if not isinstance(trainer.strategy, FixedBatchDDPStrategy):
            raise ConfigError(
                f"the trainer's strategy ({type(trainer.strategy).__name__}) is not "
                "FixedBatchDDPStrategy; build the Trainer with **elastic.trainer_kwargs(...)."
            )
        if trainer.max_steps is None or trainer.max_steps < 0:
            raise ConfigError(
                f"max_steps ({trainer.max_steps}) must be set: an elastic job is one endless "
                "epoch of fixed global batches; pass Trainer(max_steps=...)."
            )
        if not pl_module.automatic_optimization:
            raise ConfigError(
                "manual optimization (automatic_optimization=False) is not supported: the "
                "integration scales each micro-batch's loss in Lightning's backward; use "
                "automatic optimization."
            )
        # Lightning stops a signalled rank alone, without a checkpoint and with exit code 0
        # (which a launcher takes for "finished"); the drain below replaces it.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "register_signal_handlers"):
            connector.register_signal_handlers = lambda: None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Starts draining on SIGTERM, and records where training resumes."""
        elastic = self._elastic
        loader = trainer.train_dataloader
        stream = elastic.stream
        ours = stream is not None and getattr(loader, "batch_sampler", None) is stream
        if stream is None or not ours:
            raise ConfigError(
                "the training DataLoader was not made by elastic.dataloader(dataset, ...); "
                "build it there, which keeps the global batch and the data order across "
                "world changes."
            )
        if stream.step != trainer.global_step:
            raise ConfigError(
                f"the data cursor (step {stream.step}) does not match the trainer's "
                f"global step ({trainer.global_step}); resume only from checkpoints this "
                "integration wrote (ckpt_path=elastic.resume_path())."
            )
        self._last_step = trainer.global_step
        elastic.drain.install()
        self._installed = True
        started = self._setup_at if self._setup_at is not None else time.monotonic()
        elastic.reporter.restored(trainer.global_step, found=self._resumed_step is not None,
                                  duration_s=time.monotonic() - started)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        """Starts a step's clock (at its first micro-batch after a start or a save)."""
        if self._step_started is None:
            self._step_started = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step: moves the cursor, reports, agrees on draining, saves."""
        step = trainer.global_step
        if step == self._last_step:
            return  # a micro-batch within the step
        self._last_step = step
        elastic = self._elastic
        assert elastic.stream is not None
        elastic.stream.advance()
        started = self._step_started if self._step_started is not None else time.monotonic()
        elastic.reporter.step(step - 1, time.monotonic() - started)
        drain = elastic.drain.at_step_end(step)
        last = step >= trainer.max_steps
        if drain or last or step % elastic.checkpoint_every == 0:
            elastic.save(trainer, step, final=drain or last)
        if drain and not last:  # at the last step the job is finished, not drained
            elastic.drain.settle()
            elastic.reporter.drained(step)
            raise Drained(step)
        self._step_started = time.monotonic()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Settles the last agreement and gives SIGTERM back."""
        self._finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """Gives SIGTERM back before Lightning tears down (a drain, a failure)."""
        self._finish()

    def _finish(self) -> None:
        if self._installed:
            self._installed = False
            self._elastic.drain.uninstall()
        self._elastic.drain.settle()
        self._elastic.reporter.flush()


class ElasticLightning:
    """What a Lightning script needs to run under elastic-run (see the module docstring).

    Builds the default process group from the launcher's environment at once (Lightning
    keeps it), so that every rank can agree on the checkpoint to resume before ``fit``.

    Args:
        checkpoint_dir: Where checkpoints go: a local directory or an fsspec URL
            (``s3://...``), shared by every node.
        global_batch_size: Samples per optimizer step over all ranks (fixed for the job).
        accumulate_grad_batches: Micro-batches per rank and step (fixed for the job; size it
            for the smallest world).
        checkpoint_every: Save every this many steps (and at the last step and on a drain).
        keep_last: Committed checkpoints kept (older ones are deleted by rank 0).
        seed: Seed of the data order.
        shuffle: Permute each epoch (else the dataset's order).
        drop_last: Never let a step straddle two epochs.
        accelerator: ``"auto"`` (CUDA when available), ``"gpu"`` or ``"cpu"``.
        storage_options: fsspec options for a ``checkpoint_dir`` URL.
        strategy_options: Passed to ``DDPStrategy`` (``find_unused_parameters``, ...).

    Raises:
        ConfigError: On invalid values or a malformed launcher environment.
    """

    def __init__(self, checkpoint_dir: str, *, global_batch_size: int,
                 accumulate_grad_batches: int = 1, checkpoint_every: int = 100,
                 keep_last: int = 3, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, accelerator: str = "auto",
                 storage_options: Mapping[str, Any] | None = None,
                 strategy_options: Mapping[str, Any] | None = None) -> None:
        for name, value in (("global_batch_size", global_batch_size),
                            ("accumulate_grad_batches", accumulate_grad_batches),
                            ("checkpoint_every", checkpoint_every), ("keep_last", keep_last)):
            if value < 1:
                raise ConfigError(f"{name} ({value}) must be a positive integer.")
        if accelerator not in ("auto", "gpu", "cpu"):
            raise ConfigError(f"accelerator ({accelerator!r}) must be 'auto', 'gpu' or 'cpu'.")
        cuda = torch.cuda.is_available() and accelerator != "cpu"
        self.world: WorkerWorld = world_from_env()
        if self.world.world_size % self.world.local_world_size:
            raise ConfigError(
                f"WORLD_SIZE ({self.world.world_size}) is not a multiple of LOCAL_WORLD_SIZE "
                f"({self.world.local_world_size}); run every node with the same "
                "--nproc-per-node."
            )
        base = global_batch_size // self.world.world_size
        if base < accumulate_grad_batches:
            raise ConfigError(
                f"the global batch ({global_batch_size}) on {self.world.world_size} ranks "
                f"leaves shares of {base} samples, fewer than accumulate_grad_batches "
                f"({accumulate_grad_batches}); use a larger global batch or fewer "
                "accumulation steps (or cap --max-nodes)."
            )
        self.global_batch_size = global_batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.checkpoint_every = checkpoint_every
        self.keep_last = keep_last
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.accelerator = "gpu" if cuda else "cpu"
        self._strategy_options = dict(strategy_options or {})
        join_default_group(self.world, backend="nccl" if cuda else "gloo")
        device = (torch.device("cuda", self.world.local_rank) if cuda
                  else torch.device("cpu"))
        self.commits = CommitLog(checkpoint_dir, storage_options)
        self.reporter = Reporter(self.world)
        self.drain = DrainAgreement(device)
        self.stream: StepBatches | None = None
        self.callback = ElasticCallback(self)
        self.strategy = FixedBatchDDPStrategy(self, **self._strategy_options)
        self._resume: Committed | None = None

    # -- what the script calls --------------------------------------------------------------

    def dataloader(self, dataset: Dataset[Any], **options: Any) -> DataLoader[Any]:
        """The training ``DataLoader``: this rank's micro-batches of each step.

        Args:
            dataset: A map-style dataset (with ``__len__``).
            options: Other ``DataLoader`` arguments (``num_workers``, ``collate_fn``,
                ``pin_memory``, ...); not ``batch_size``, ``shuffle``, ``sampler`` or
                ``batch_sampler``, which the global batch decides.

        Raises:
            ConfigError: On an argument the global batch decides, or a dataset without a
                length.
        """
        taken = sorted({"batch_size", "shuffle", "sampler", "batch_sampler",
                        "drop_last"} & set(options))
        if taken:
            raise ConfigError(
                f"DataLoader arguments ({', '.join(taken)}) are decided by the global batch; "
                "leave them out (pass shuffle/seed/drop_last to ElasticLightning)."
            )
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"the dataset ({type(dataset).__name__}) has no length; the integration needs "
                "a map-style dataset (an IterableDataset keeps its own order)."
            ) from None
        share = self.global_batch_size // self.world.world_size + (
            1 if self.world.rank < self.global_batch_size % self.world.world_size else 0)
        self.stream = StepBatches(
            size, global_batch_size=self.global_batch_size, rank=self.world.rank,
            world_size=self.world.world_size,
            micro_batch_sizes=even_split(share, self.accumulate_grad_batches),
            seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last)
        loader: DataLoader[Any] = DataLoader(dataset, batch_sampler=self.stream, **options)
        shield_workers_from_sigterm(loader)
        return loader

    def trainer_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """``Trainer`` arguments: the script's ``kwargs`` plus the strategy, the world's
        devices and nodes, the accumulation, the callback, and no distributed sampler.

        Raises:
            ConfigError: If ``kwargs`` set one of those differently.
        """
        world = self.world
        decided: dict[str, Any] = {
            "strategy": self.strategy,
            "accelerator": self.accelerator,
            "devices": world.local_world_size,
            "num_nodes": world.world_size // world.local_world_size,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "use_distributed_sampler": False,
        }
        for key, value in decided.items():
            if key in kwargs and kwargs[key] != value and not (
                    key == "accelerator" and kwargs[key] == "auto"):
                raise ConfigError(
                    f"Trainer argument {key} ({kwargs[key]!r}) is decided by the elastic job "
                    f"({value!r}); leave it out."
                )
        callbacks: Sequence[Callback] = list(kwargs.pop("callbacks", None) or [])
        out = {**kwargs, **decided, "callbacks": [*callbacks, self.callback]}
        if not any(isinstance(c, Checkpoint) for c in callbacks):
            # Lightning's default ModelCheckpoint would save at the (only) epoch's end too.
            out.setdefault("enable_checkpointing", False)
        return out

    def resume_path(self) -> str | None:
        """The newest committed checkpoint (``ckpt_path``), the same on every rank; ``None``
        on a fresh start."""
        newest = self.commits.newest() if self.world.rank == 0 else None
        self._resume = agree(newest)
        if self._resume is None:
            logger.info("fresh start: no committed checkpoint in %s", self.commits.directory)
            return None
        logger.info("resuming from %s (step %d)", self._resume.path, self._resume.step)
        return self._resume.path

    # -- saving (every rank) ----------------------------------------------------------------

    def save(self, trainer: pl.Trainer, step: int, *, final: bool) -> None:
        """Saves the checkpoint of ``step`` through Lightning (every rank calls it), then
        rank 0 commits it and deletes the committed ones beyond ``keep_last``."""
        name = _NAME.format(step=step)
        started = time.monotonic()
        rank0 = self.world.rank == 0
        try:
            if rank0:
                self.commits.invalidate(name)
            trainer.save_checkpoint(self.commits.path_of(name), weights_only=False)  # a barrier
            if rank0:
                assert self.stream is not None
                self.commits.commit(name, step, {
                    "global_batch_size": self.global_batch_size,
                    "accumulation": self.accumulate_grad_batches,
                    "world": self.world.world_size, "final": final,
                    "order": self.stream.sampler.state_dict()})
                self._prune()
        except Exception as exc:
            self.reporter.checkpoint_failed(step, exc)
            raise
        took = time.monotonic() - started
        self.reporter.checkpoint(step, took, final=final)
        if rank0:
            self.reporter.committed(step, took)

    def _prune(self) -> None:
        """Deletes the committed checkpoints beyond ``keep_last``, and the ones older than the
        newest committed that never were (cut off by a crash before their commit)."""
        committed = self.commits.committed()
        doomed = [c.name for c in committed[:-self.keep_last]]
        if committed:
            names = {c.name for c in committed}
            newest = committed[-1].step
            doomed += [n for n in self.commits.storage.list_names(self.commits.storage.root)
                       if (found := _STEP.fullmatch(n)) and int(found.group(1)) < newest
                       and n not in names]
        for name in doomed:
            try:
                self.commits.remove(name)
            except OSError as exc:  # an old checkpoint left behind costs space, not training
                logger.warning("could not delete old checkpoint %s (%s)", name, exc)

