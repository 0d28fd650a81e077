"""Batch plans keep the global batch fixed and the gradient equal to the global-batch mean."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic.batching import BatchPlan, plan_batches
from elastic.errors import ConfigError


def test_a_divisible_world_keeps_the_requested_micro_batch() -> None:
    plan = plan_batches(64, 8, 4)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.samples_per_rank) == (8, 2, 16)
    assert plan.loss_scale == 0.5
    assert plan.global_batch_size == 64


def test_the_micro_batch_shrinks_to_the_largest_divisor_of_the_per_rank_share() -> None:
    plan = plan_batches(24, 5, 2)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.samples_per_rank) == (4, 3, 12)
    assert plan.requested_micro_batch_size == 5


def test_a_micro_batch_larger_than_the_per_rank_share_is_capped_without_accumulation() -> None:
    plan = plan_batches(12, 32, 3)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.loss_scale) == (4, 1, 1.0)


@given(
    global_batch=st.integers(1, 512),
    micro=st.integers(1, 64),
    world=st.integers(1, 64),
)
def test_a_plan_is_exact_and_uses_the_largest_usable_micro_batch_or_raises(
    global_batch: int, micro: int, world: int
) -> None:
    if global_batch % world != 0:
        with pytest.raises(ConfigError):
            plan_batches(global_batch, micro, world)
        return
    plan = plan_batches(global_batch, micro, world)
    assert plan.world_size * plan.micro_batch_size * plan.grad_accum_steps == global_batch
    assert plan.micro_batch_size <= micro
    per_rank = global_batch // world
    assert all(per_rank % m != 0 for m in range(plan.micro_batch_size + 1, micro + 1))
    assert plan.loss_scale == pytest.approx(1 / plan.grad_accum_steps)


def test_a_world_that_does_not_divide_the_global_batch_is_a_one_sentence_error() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^global batch size \(12\) with micro batch size \(4\) cannot be split evenly "
        r"over world size \(5\); run on a world size that divides the global batch "
        r"\(e\.g\. 4 or 6\) or change the global batch size\.$",
    ):
        plan_batches(12, 4, 5)


def test_a_world_larger_than_the_global_batch_suggests_only_smaller_worlds() -> None:
    with pytest.raises(ConfigError, match=r"\(e\.g\. 8\) or change"):
        plan_batches(8, 4, 9)


@pytest.mark.parametrize("name", ["global_batch_size", "micro_batch_size", "world_size"])
def test_a_non_positive_value_is_a_config_error_naming_it(name: str) -> None:
    args = {"global_batch_size": 8, "micro_batch_size": 2, "world_size": 2, name: 0}
    with pytest.raises(ConfigError, match=rf"^{name} \(0\) must be a positive integer\.$"):
        plan_batches(**args)


def test_a_hand_built_inconsistent_plan_is_refused() -> None:
    plan = plan_batches(8, 2, 2)
    with pytest.raises(ConfigError, match=r"^inconsistent batch plan"):
        dataclasses.replace(plan, grad_accum_steps=3)


def test_a_plan_is_frozen() -> None:
    plan = plan_batches(8, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world_size = 4  # type: ignore[misc]


def _mean_gradient_by_plan(
    plan: BatchPlan, weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Accumulates scaled micro-batch gradients per rank, then averages like DDP does."""
    per_rank = []
    for rank in range(plan.world_size):
        rank_x = x[rank :: plan.world_size]
        rank_y = y[rank :: plan.world_size]
        assert rank_x.shape[0] == plan.samples_per_rank
        w = weight.clone().requires_grad_(True)
        for step in range(plan.grad_accum_steps):
            chunk = slice(step * plan.micro_batch_size, (step + 1) * plan.micro_batch_size)
            loss = ((rank_x[chunk] @ w - rank_y[chunk]) ** 2).mean()
            (loss * plan.loss_scale).backward()
        assert w.grad is not None
        per_rank.append(w.grad)
    return torch.stack(per_rank).mean(dim=0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_scaled_accumulated_gradients_averaged_over_ranks_equal_the_global_batch_mean(
    world_size: int,
) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(24, dtype=torch.float64, generator=generator)
    weight = torch.randn(3, dtype=torch.float64, generator=generator)
    reference = weight.clone().requires_grad_(True)
    ((x @ reference - y) ** 2).mean().backward()
    assert reference.grad is not None

    plan = plan_batches(24, 3, world_size)
    assert plan.grad_accum_steps > 1

    torch.testing.assert_close(
        _mean_gradient_by_plan(plan, weight, x, y), reference.grad, rtol=0, atol=1e-12
    )


def _ddp_worker(rank: int, world_size: int, workdir: str) -> None:
    """One real DDP rank: sampler from the process group, plan, no_sync accumulation."""
    import contextlib
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic.sampler import ElasticSampler

    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(workdir, 'store')}",
        rank=rank,
        world_size=world_size,
    )
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(24, 3, dtype=torch.float64, generator=generator)
        y = torch.randn(24, 1, dtype=torch.float64, generator=generator)
        model = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64))
        ddp = DistributedDataParallel(model)
        sampler = ElasticSampler(24, seed=3)  # rank and world from the process group
        plan = plan_batches(24, 5, dist.get_world_size())
        indices = list(sampler)[: plan.samples_per_rank]
        for step in range(plan.grad_accum_steps):
            batch = indices[step * plan.micro_batch_size : (step + 1) * plan.micro_batch_size]
            last = step == plan.grad_accum_steps - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ((ddp(x[batch]) - y[batch]) ** 2).mean()
                (loss * plan.loss_scale).backward()
        assert model.weight.grad is not None
        torch.save(model.weight.grad, os.path.join(workdir, f"grad{rank}.pt"))
        # Both ranks are done with the group before either tears it down, and DDP's reducer
        # goes first: a gloo thread still running at exit aborts the process (seen in CI).
        dist.barrier()
        del ddp
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_real_ddp_over_gloo_with_the_plan_gives_the_global_batch_mean_gradient(
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2, join=True, daemon=True)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(24, 1, dtype=torch.float64, generator=generator)
    weight = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    ((x @ weight.T - y) ** 2).mean().backward()
    for rank in range(2):
        grad = torch.load(tmp_path / f"grad{rank}.pt")
        torch.testing.assert_close(grad, weight.grad, rtol=0, atol=1e-12)
