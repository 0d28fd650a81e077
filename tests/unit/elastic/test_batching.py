"""Batch plans split a fixed global batch over any world size; the gradient stays the mean."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elastic.batching import BatchPlan, plan_batches
from elastic_errors import ConfigError


def test_a_divisible_world_keeps_the_requested_micro_batch() -> None:
    plan = plan_batches(64, 8, 4)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.samples_per_rank) == (8, 2, 16)
    assert plan.loss_scale == 0.5 and plan.even
    assert [plan.micro_batch_sizes(r) for r in range(4)] == [(8, 8)] * 4


def test_the_headline_world_of_three_splits_64_unevenly() -> None:
    plan = plan_batches(64, 16, 3)
    assert [plan.share(r) for r in range(3)] == [22, 21, 21]
    assert [plan.micro_batch_sizes(r) for r in range(3)] == [(16, 6), (16, 5), (16, 5)]
    assert not plan.even and plan.grad_accum_steps == 2


def test_a_prime_share_keeps_full_micro_batches_and_a_short_last_one() -> None:
    plan = plan_batches(23, 4, 1)  # share 23, prime
    assert plan.micro_batch_sizes(0) == (4, 4, 4, 4, 4, 3)


def test_every_rank_runs_the_same_number_of_micro_batches() -> None:
    # Shares 17 and 16 with micro-batches of 16: the rank with 16 splits one sample off.
    plan = plan_batches(33, 16, 2)
    assert plan.micro_batch_sizes(0) == (16, 1)
    assert plan.micro_batch_sizes(1) == (15, 1)


def test_a_micro_batch_larger_than_the_share_is_capped_without_accumulation() -> None:
    plan = plan_batches(12, 32, 3)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.loss_scale) == (4, 1, 1.0)


@given(global_batch=st.integers(1, 512), micro=st.integers(1, 64), world=st.integers(1, 64))
def test_shares_and_micro_batches_follow_the_rules(global_batch: int, micro: int,
                                                   world: int) -> None:
    if world > global_batch:
        with pytest.raises(ConfigError):
            plan_batches(global_batch, micro, world)
        return
    plan = plan_batches(global_batch, micro, world)
    shares = [plan.share(r) for r in range(world)]
    assert sum(shares) == global_batch and max(shares) - min(shares) <= 1
    counts = set()
    for rank in range(world):
        sizes = plan.micro_batch_sizes(rank)
        assert sum(sizes) == shares[rank] and all(0 < s <= micro for s in sizes)
        # All full but the last (or the last two, when one sample is split off).
        assert all(s == plan.micro_batch_size for s in sizes[:-2])
        counts.add(len(sizes))
    # The same number of forwards on every rank (micro-batches of one sample excepted).
    assert len(counts) == 1 or plan.micro_batch_size == 1
    # A micro-batch of one sample only when nothing larger fits.
    if plan.micro_batch_size == 1:
        assert micro == 1 or max(shares) == 1


def test_a_world_larger_than_the_global_batch_is_a_one_sentence_error() -> None:
    with pytest.raises(ConfigError, match=r"^world size \(9\) is larger than the global batch "
                       r"size \(8\), which would leave ranks without a sample; use a larger "
                       r"global batch \(the extra workers otherwise wait as spares\)\.$"):
        plan_batches(8, 4, 9)


@pytest.mark.parametrize("name", ["global_batch_size", "micro_batch_size", "world_size"])
def test_a_non_positive_value_is_a_config_error_naming_it(name: str) -> None:
    args = {"global_batch_size": 8, "micro_batch_size": 2, "world_size": 2, name: 0}
    with pytest.raises(ConfigError, match=rf"^{name} \(0\) must be a positive integer\.$"):
        plan_batches(**args)


def test_a_plan_is_frozen() -> None:
    plan = plan_batches(8, 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world_size = 4  # type: ignore[misc]


def _mean_gradient_by_plan(
    plan: BatchPlan, weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Each rank accumulates its scaled micro-batch gradients; then the mean, as DDP does."""
    per_rank = []
    for rank in range(plan.world_size):
        # The step's positions j with j % W == rank (ElasticSampler's split).
        rank_x, rank_y = x[rank :: plan.world_size], y[rank :: plan.world_size]
        assert rank_x.shape[0] == plan.share(rank)
        w = weight.clone().requires_grad_(True)
        start = 0
        for size in plan.micro_batch_sizes(rank):
            chunk = slice(start, start + size)
            start += size
            loss = ((rank_x[chunk] @ w - rank_y[chunk]) ** 2).mean()
            (loss * plan.loss_scale_for(size)).backward()
        assert w.grad is not None
        per_rank.append(w.grad)
    return torch.stack(per_rank).mean(dim=0)


@given(world_size=st.integers(1, 8), global_batch=st.sampled_from([23, 24, 29, 31, 64]),
       micro=st.integers(1, 9))
def test_scaled_accumulated_gradients_averaged_over_ranks_equal_the_global_batch_mean(
    world_size: int, global_batch: int, micro: int,
) -> None:
    generator = torch.Generator().manual_seed(global_batch)
    x = torch.randn(global_batch, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(global_batch, dtype=torch.float64, generator=generator)
    weight = torch.randn(3, dtype=torch.float64, generator=generator)
    reference = weight.clone().requires_grad_(True)
    ((x @ reference - y) ** 2).mean().backward()
    assert reference.grad is not None
    plan = plan_batches(global_batch, micro, world_size)
    torch.testing.assert_close(_mean_gradient_by_plan(plan, weight, x, y), reference.grad,
                               rtol=0, atol=1e-12)


_G, _M = 23, 5  # a prime global batch over 3 ranks: shares 8, 8, 7


def _ddp_worker(rank: int, world_size: int, workdir: str) -> None:
    """One real DDP rank: the sampler's split, the plan's micro-batches, no_sync accumulation."""
    import contextlib
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic.sampler import ElasticSampler

    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank,
        world_size=world_size,
    )
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(_G, 3, dtype=torch.float64, generator=generator)
        y = torch.randn(_G, 1, dtype=torch.float64, generator=generator)
        model = torch.nn.Linear(3, 1, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64))
        ddp = DistributedDataParallel(model)
        sampler = ElasticSampler(_G, seed=3)  # rank and world from the process group
        sampler.set_global_batch_size(_G)
        plan = plan_batches(_G, _M, dist.get_world_size())
        batches = sampler.micro_batches(plan)
        sizes = plan.micro_batch_sizes(rank)
        for index, size in enumerate(sizes):
            batch = next(batches)
            assert len(batch) == size
            last = index == len(sizes) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ((ddp(x[batch]) - y[batch]) ** 2).mean()
                (loss * plan.loss_scale_for(size)).backward()
        assert model.weight.grad is not None
        torch.save(model.weight.grad, os.path.join(workdir, f"grad{rank}.pt"))
        # Every rank is done with the group before any tears it down, and DDP's reducer
        # goes first: a gloo thread still running at exit aborts the process (seen in CI).
        dist.barrier()
        del ddp
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_real_ddp_over_gloo_with_an_uneven_split_gives_the_global_batch_mean_gradient(
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(3, str(tmp_path)), nprocs=3, join=True, daemon=True)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_G, 3, dtype=torch.float64, generator=generator)
    y = torch.randn(_G, 1, dtype=torch.float64, generator=generator)
    weight = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    ((x @ weight.T - y) ** 2).mean().backward()
    for rank in range(3):
        grad = torch.load(tmp_path / f"grad{rank}.pt")
        torch.testing.assert_close(grad, weight.grad, rtol=0, atol=1e-12)
