"""elastic-run for Hugging Face ``Trainer`` scripts (the ``hf`` extra).

Two lines of a ``Trainer`` script change::

    from elastic.integrations.hf import ElasticTrainer
    trainer = ElasticTrainer(model=model, args=args, train_dataset=dataset,   # was Trainer(...)
                             global_batch_size=256)
    trainer.train()

and the script then, under ``elastic-run`` (or torchrun, or alone):

* **resumes** from the newest committed ``checkpoint-N`` in ``args.output_dir`` (``train()``
  with no ``resume_from_checkpoint``): ``Trainer`` writes its checkpoints every
  ``save_steps`` as it always does, and :class:`ElasticCallback` commits each one
  (:mod:`~elastic.integrations._commits`) once every rank's files are durable; rank 0 chooses
  the newest committed one and every rank loads it. ``Trainer``'s own "last checkpoint"
  would take a half-written directory;
* **drains**: a SIGTERM (the agent's, on a preemption notice or a world change) becomes a
  final checkpoint at a step boundary every rank agrees on; the worker tells its agent it
  drained and ``train()`` ends with exit code 143 (a stop, not a failure; the preempted
  node's agent exits 0);
* **reports** steps, checkpoint times and restores to the agent (``elastic-run goodput``,
  ``--metrics-port``);
* keeps the **global batch** fixed and the data order **exactly once** at any world size:
  the training loader (``get_train_dataloader``) yields this rank's share of each step in
  micro-batches of at most ``micro_batch_size`` samples
  (:mod:`~elastic.integrations._data`), with the accumulation steps of this world, and a
  per-sample mean loss is scaled so that the gradient is the mean over the global batch.

``ElasticTrainer`` sets ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and
``ignore_data_skip`` in ``args`` (the global batch decides them); the data cursor follows
``global_step``. ``docs/frameworks.md`` lists what is left out.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import SaveStrategy

from elastic.batching import plan_batches
from elastic.integrations._commits import CommitLog, Committed
from elastic.integrations._data import StepBatches
from elastic.integrations._drain import DRAINED_EXIT_CODE, DrainAgreement, Drained
from elastic.integrations._reporting import Reporter
from elastic.integrations._world import WorkerWorld, agree, world_from_env
from elastic.loop.signals import shield_workers_from_sigterm
from elastic_errors import ConfigError

__all__ = ["DRAINED_EXIT_CODE", "Drained", "ElasticCallback", "ElasticTrainer"]

logger = logging.getLogger(__name__)


_PREFIX = "checkpoint"


class ElasticCallback(TrainerCallback):  # type: ignore[misc]
    """Commits, drains and reports for an :class:`ElasticTrainer` (which adds it)."""

    def __init__(self, trainer: ElasticTrainer) -> None:
        self._trainer = trainer
        self._step_started: float | None = None
        self._mark = 0.0
        self._installed = False
        self._drained_at: int | None = None

    @property
    def _elastic(self) -> _ElasticParts:
        return self._trainer.elastic

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        """Puts the data cursor at the resumed step; starts draining on SIGTERM."""
        parts = self._elastic
        stream = parts.stream
        if stream is None:
            raise ConfigError("the training loader was not built by ElasticTrainer; do not "
                              "override get_train_dataloader.")
        order = parts.resumed.meta.get("order") if parts.resumed is not None else None
        if isinstance(order, dict):
            stream.sampler.load_state_dict(order)  # refuses another data order, with a reason
        stream.seek(state.global_step)
        parts.drain.install()
        self._installed = True
        self._step_started = None
        parts.reporter.restored(state.global_step, found=parts.resumed is not None,
                                duration_s=time.monotonic() - parts.train_called)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        """Starts a step's clock (at the first step after a start, a save or a log)."""
        if self._step_started is None:
            self._step_started = time.monotonic()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """After an optimizer step: moves the cursor, reports, agrees on draining."""
        parts = self._elastic
        step = state.global_step
        assert parts.stream is not None
        parts.stream.advance()
        started = self._step_started if self._step_started is not None else time.monotonic()
        parts.reporter.step(step - 1, time.monotonic() - started)
        if parts.drain.at_step_end(step):
            self._drained_at = step
            control.should_save = True
            control.should_training_stop = True
        if step >= state.max_steps:
            control.should_save = True
        if control.should_save and parts.world.rank == 0:
            parts.commits.invalidate(f"{_PREFIX}-{step}")  # it is about to be written again
        self._mark = time.monotonic()
        self._step_started = self._mark

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               **kwargs: Any) -> None:
        """Logging is not checkpoint time."""
        self._mark = self._step_started = time.monotonic()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        """Evaluation is not checkpoint time."""
        self._mark = self._step_started = time.monotonic()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """Commits the checkpoint ``Trainer`` just wrote, once every rank wrote its part."""
        parts = self._elastic
        step = state.global_step
        final = self._drained_at == step or step >= state.max_steps
        try:
            if dist.is_initialized():
                dist.barrier()  # each rank wrote its RNG state; rank 0 the rest
            if parts.world.rank == 0:
                assert parts.stream is not None
                parts.commits.commit(f"{_PREFIX}-{step}", step, {
                    "global_batch_size": parts.global_batch_size,
                    "world": parts.world.world_size, "final": final,
                    "order": parts.stream.sampler.state_dict()})
                parts.commits.forget_missing()  # Trainer's rotation deleted some
        except Exception as exc:
            parts.reporter.checkpoint_failed(step, exc)
            raise
        took = time.monotonic() - self._mark
        parts.reporter.checkpoint(step, took, final=final)
        if parts.world.rank == 0:
            parts.reporter.committed(step, took)
        self._mark = self._step_started = time.monotonic()

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        """Settles the last agreement, gives SIGTERM back, and ends a drained worker."""
        parts = self._elastic
        if self._installed:
            self._installed = False
            parts.drain.uninstall()
        parts.drain.settle()
        parts.reporter.flush()
        if self._drained_at is not None and state.global_step < state.max_steps:
            parts.reporter.drained(self._drained_at)
            raise Drained(self._drained_at)


class _ElasticParts:
    """What an :class:`ElasticTrainer` keeps for the integration."""

    def __init__(self, world: WorkerWorld, output_dir: str, global_batch_size: int,
                 micro_batch_size: int, seed: int, shuffle: bool, drop_last: bool,
                 device: torch.device) -> None:
        self.world = world
        self.global_batch_size = global_batch_size
        self.plan = plan_batches(global_batch_size, micro_batch_size, world.world_size)
        sizes = self.plan.micro_batch_sizes(world.rank)
        if len(sizes) != self.plan.grad_accum_steps:
            raise ConfigError(
                f"micro_batch_size ({micro_batch_size}) leaves rank {world.rank} with one "
                f"micro-batch fewer than the others on {world.world_size} ranks; use a "
                "micro_batch_size of at least 2."
            )
        self.micro_batch_sizes = sizes
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.commits = CommitLog(output_dir)
        self.reporter = Reporter(world)
        self.drain = DrainAgreement(device)
        self.stream: StepBatches | None = None
        self.resumed: Committed | None = None
        self.train_called = time.monotonic()
        self.micro_index = 0


class ElasticTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` under elastic-run (see the module docstring).

    Args:
        args: ``Trainer``'s positional arguments (``model``, ``args``, ...).
        global_batch_size: Samples per optimizer step over all ranks (fixed for the job).
        micro_batch_size: The most samples a rank runs in one forward and backward pass
            (``None``: ``args.per_device_train_batch_size``).
        data_seed: Seed of the data order (``None``: ``args.data_seed``, else ``args.seed``).
        shuffle: Permute each epoch (else the dataset's order).
        drop_last: Never let a step straddle two epochs.
        kwargs: ``Trainer``'s keyword arguments.

    Raises:
        ConfigError: On invalid values, or ``args`` that cannot checkpoint this job.
    """

    def __init__(self, *args: Any, global_batch_size: int,
                 micro_batch_size: int | None = None, data_seed: int | None = None,
                 shuffle: bool = True, drop_last: bool = False, **kwargs: Any) -> None:
        bound = inspect.signature(Trainer.__init__).bind_partial(None, *args, **kwargs)
        training_args = bound.arguments.get("args")
        if not isinstance(training_args, TrainingArguments):
            raise ConfigError("ElasticTrainer needs args=TrainingArguments(output_dir=...): "
                              "the checkpoints live in args.output_dir.")
        _check_args(training_args)
        if not training_args.output_dir:
            raise ConfigError("args.output_dir is not set; the checkpoints live there.")
        micro = micro_batch_size or training_args.per_device_train_batch_size
        if global_batch_size < 1 or micro < 1:
            raise ConfigError(f"global_batch_size ({global_batch_size}) and micro_batch_size "
                              f"({micro}) must be positive integers.")
        env_world = world_from_env()
        if training_args.world_size != env_world.world_size:
            raise ConfigError(
                f"the launcher started {env_world.world_size} workers but Trainer runs this "
                f"one in a world of ({training_args.world_size}) (parallel mode "
                f"{training_args.parallel_mode.value}), so they would train as separate jobs; "
                "on a machine without CUDA pass TrainingArguments(use_cpu=True)."
            )
        # Trainer's arguments set up the process group (accelerate); its world is ours.
        world = WorkerWorld(rank=training_args.process_index,
                            world_size=training_args.world_size,
                            local_rank=max(0, training_args.local_process_index),
                            local_world_size=env_world.local_world_size,
                            launched=env_world.launched, round=env_world.round)
        seed = data_seed if data_seed is not None else (
            training_args.data_seed if training_args.data_seed is not None
            else training_args.seed)
        parts = _ElasticParts(world, str(training_args.output_dir), global_batch_size, micro, seed,
                              shuffle, drop_last, training_args.device)
        training_args.per_device_train_batch_size = parts.plan.micro_batch_size
        training_args.gradient_accumulation_steps = parts.plan.grad_accum_steps
        training_args.ignore_data_skip = True  # the cursor follows global_step instead
        self.elastic = parts
        self._elastic_factor: float | None = None
        super().__init__(*args, **kwargs)
        self.add_callback(ElasticCallback(self))

    # -- resuming ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``, resuming by default from the newest committed checkpoint (the
        same on every rank); a path given is used as it is.

        Raises:
            ConfigError: If the checkpoint was trained with another global batch or data
                order.
        """
        parts = self.elastic
        parts.train_called = time.monotonic()
        if resume_from_checkpoint is None or resume_from_checkpoint is True:
            newest = parts.commits.newest() if parts.world.rank == 0 else None
            parts.resumed = agree(newest)
            if parts.resumed is not None:
                _check_meta(parts, parts.resumed.meta)
                logger.info("resuming from %s (step %d)", parts.resumed.path,
                            parts.resumed.step)
            resume_from_checkpoint = parts.resumed.path if parts.resumed is not None else None
        elif resume_from_checkpoint is False:
            resume_from_checkpoint = None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    # -- data -------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader[Any]:
        """This rank's micro-batches of each step (not sharded again by accelerate)."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"the train_dataset ({type(dataset).__name__}) has no length; the integration "
                "needs a map-style dataset (an IterableDataset keeps its own order)."
            ) from None
        collator = self.data_collator
        # Trainer's own column handling, as its get_train_dataloader does.
        remove_columns = getattr(self, "_remove_unused_columns", None)
        wrap_collator = getattr(self, "_get_collator_with_removed_columns", None)
        if _is_datasets_dataset(dataset) and remove_columns is not None:
            dataset = remove_columns(dataset, description="training")
        elif wrap_collator is not None:
            collator = wrap_collator(collator, description="training")
        parts = self.elastic
        parts.stream = StepBatches(
            size, global_batch_size=parts.global_batch_size, rank=parts.world.rank,
            world_size=parts.world.world_size, micro_batch_sizes=parts.micro_batch_sizes,
            seed=parts.seed, shuffle=parts.shuffle, drop_last=parts.drop_last)
        args = self.args
        options: dict[str, Any] = {"num_workers": args.dataloader_num_workers,
                                   "pin_memory": args.dataloader_pin_memory}
        if args.dataloader_num_workers > 0:
            options["persistent_workers"] = args.dataloader_persistent_workers
            if args.dataloader_prefetch_factor is not None:
                options["prefetch_factor"] = args.dataloader_prefetch_factor
        loader: DataLoader[Any] = DataLoader(dataset, batch_sampler=parts.stream,
                                             collate_fn=collator, **options)
        shield_workers_from_sigterm(loader)
        return loader

    # -- the loss ---------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step``, with this micro-batch's factor for the global batch
        (:meth:`StepBatches.loss_factor`) when the loss is a per-batch mean."""
        parts = self.elastic
        index = parts.micro_index
        parts.micro_index = (index + 1) % parts.plan.grad_accum_steps
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # how Trainer decides that it divides the loss by the steps
            scaled = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                      or self.compute_loss_func is not None)
        stream = parts.stream
        self._elastic_factor = None if scaled or stream is None else stream.loss_factor(index)
        try:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._elastic_factor = None
        return loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any],
                     return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """``Trainer.compute_loss``, times the factor :meth:`training_step` set."""
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        factor = self._elastic_factor
        if factor is None:
            return result
        if isinstance(result, tuple):  # return_outputs
            loss, outputs = result
            return loss * factor, outputs
        return result * factor


def _check_args(args: TrainingArguments) -> None:
    """Refuses arguments that cannot checkpoint an elastic job."""
    if args.save_strategy != SaveStrategy.STEPS:
        raise ConfigError(
            f"save_strategy ({getattr(args.save_strategy, 'value', args.save_strategy)}) must "
            "be 'steps': an elastic job is one "
            "endless epoch of fixed global batches; set save_steps too."
        )
    if args.max_steps is None or args.max_steps <= 0:
        raise ConfigError(
            f"max_steps ({args.max_steps}) must be set: an elastic job is one endless epoch "
            "of fixed global batches."
        )
    if args.save_total_limit == 1:
        raise ConfigError(
            "save_total_limit (1) would delete the newest committed checkpoint before the "
            "next one is committed; use 2 or more (or None)."
        )


def _check_meta(parts: _ElasticParts, meta: Mapping[str, Any]) -> None:
    saved = meta.get("global_batch_size")
    if saved != parts.global_batch_size:
        raise ConfigError(
            f"the checkpoint was trained with global batch size ({saved}) but this job asks "
            f"for ({parts.global_batch_size}); keep it fixed for a job or use a new "
            "output_dir."
        )


def _is_datasets_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` (without importing ``datasets``)."""
    return any(f"{c.__module__}.{c.__qualname__}" == "datasets.arrow_dataset.Dataset"
               for c in type(dataset).__mro__)
