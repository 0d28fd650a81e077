"""What users run on GPUs, run on a GPU: CUDA checkpoints, in-place healing of CUDA state, and
aborting an NCCL communicator from another thread.

Every test here needs CUDA and skips, with the reason, where ``torch.cuda.is_available()`` is
false (CI and the CPU machines). One GPU cannot host two NCCL ranks, so the multi-rank tests
run their ranks over gloo, which moves CUDA tensors (several processes share the GPU), and
the NCCL test uses a world of one; ``docs/gpu.md`` says what that does and does not
prove for multi-GPU NCCL. Run them with::

    python -m pytest -q -s tests/gpu
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device (torch.cuda.is_available() is False): the gpu "
                              "tests run where CUDA is present"),
]

REPO = Path(__file__).resolve().parents[2]
_STEP = 3
_ROWS = 9  # the DTensor's rows: 5 and 4 on two ranks


def _device(rank: int) -> torch.device:
    """This rank's GPU: ranks share the GPUs there are (all on one when there is one)."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # CUDA is initialised: DeviceMesh keeps this device
    return device


def _model(device: torch.device, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4)).double().to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int,
           device: torch.device) -> None:
    for i in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 + i),
                        dtype=torch.float64).to(device)
        optim.zero_grad()
        model(x).pow(2).mean().backward()
        optim.step()


def _flat(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors, copied to the host, keyed by name."""
    out = {f"m.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o.{pid}.{k}"] = torch.as_tensor(v).cpu().clone()
    return out


def _full_rows(device: torch.device) -> torch.Tensor:
    return (torch.arange(_ROWS * 3, dtype=torch.float32, device=device).reshape(_ROWS, 3)
            * 0.5 + 0.25)


def _save_worker(rank: int, world: int, port: int, root: str, ref: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from checkpointing import CheckpointManager, ModelOptimizerState
    from tests.integration.checkpointing.test_resharding import _init, _owned

    device = _device(rank)
    _init(rank, world, port)
    try:
        model, optim = _model(device, seed=0)
        _train(model, optim, _STEP, device)
        # The replicas must be bit-identical, as DDP keeps them: rank 0's values, through
        # the host (the test relies on no CUDA collective of gloo's).
        for t in [*model.state_dict().values(),
                  *(v for st in optim.state.values() for v in st.values())]:
            host = t.detach().cpu()
            dist.broadcast(host, 0)
            t.detach().copy_(host)
        # A DTensor sharded unevenly on a CUDA mesh (what FSDP2 and tensor parallelism
        # hold): each rank builds its own shard, no collective.
        mesh = init_device_mesh(device.type, (world,))
        full = _full_rows(device)
        local = full.chunk(world)[rank].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape,
                                     stride=full.stride())
        extra: dict[str, Any] = {"step": _STEP, "t": torch.tensor([1.5, -2.0], device=device)}
        state = {
            "train": ModelOptimizerState(model, optim, extra=extra),
            "sharded": {"w": sharded},
            "owned": {f"r{rank}": _owned(rank).to(device)},  # a key only this rank has
        }
        with CheckpointManager(root, run_id="reshard-cuda") as mgr:
            info = mgr.save(_STEP, state).committed.result(timeout=120)
            assert info.world_size == world
        assert all(t.device == device for t in model.state_dict().values())
        if rank == 0:
            torch.save({"train": _flat(model, optim), "sharded": full.cpu(),
                        "owned": {f"r{r}": _owned(r) for r in range(world)},
                        "t": extra["t"].cpu()}, ref)
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, root: str, ref: str) -> None:
    from checkpointing import CheckpointManager, ModelOptimizerState
    from tests.integration.checkpointing.test_resharding import _init

    device = _device(rank)
    _init(rank, world, port)
    try:
        model, optim = _model(device, seed=100)
        _train(model, optim, 1, device)  # optimizer state exists and differs before the load
        extra: dict[str, Any] = {"step": 0, "t": torch.zeros(2, device=device)}
        sharded = {"w": torch.zeros(_ROWS, 3, device=device)}  # the whole tensor on one rank
        owned = {f"r{r}": torch.zeros(7, dtype=torch.float64, device=device) for r in (0, 1)}
        state = {"train": ModelOptimizerState(model, optim, extra=extra), "sharded": sharded,
                 "owned": owned}
        with CheckpointManager(root) as mgr:
            info = mgr.load(state)
        assert info is not None and info.step == _STEP and info.world_size == 2
        expected = torch.load(ref, weights_only=True)
        got = _flat(model, optim)
        assert got.keys() == expected["train"].keys(), (sorted(got), sorted(expected["train"]))
        for key, want in expected["train"].items():
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
        # Restored where they live: on the GPU (the optimizer's step counts stay on the host).
        assert all(t.device == device for t in model.state_dict().values())
        assert all(v.device == device for st in optim.state.values()
                   for k, v in st.items() if k != "step")
        for name, tensor in (("sharded", sharded["w"]), *owned.items(), ("t", extra["t"])):
            want = expected["sharded"] if name == "sharded" else (
                expected["t"] if name == "t" else expected["owned"][name])
            assert tensor.device == device, name
            assert torch.equal(tensor.cpu(), want), name
        assert extra["step"] == _STEP
    finally:
        dist.destroy_process_group()


def test_cuda_state_checkpoints_and_restores_bit_identically_resharded_2_to_1(
    tmp_path: Path,
) -> None:
    # The CPU re-sharding test's runner: ranks forked from a fork server (which never
    # touches CUDA), each exit code checked.
    from tests.integration.checkpointing.test_resharding import _run

    root, ref = tmp_path / "ckpt", tmp_path / "expected.pt"
    _run(_save_worker, 2, str(root), str(ref))
    assert {p.name.split("_")[2] for p in (root / f"step-{_STEP:010d}_r0000").glob("*.distcp")
            } == {"0", "1"}  # both ranks wrote
    _run(_load_worker, 1, str(root), str(ref))


# ------------------------------------------------------------------ in place, CUDA tensors


@pytest.fixture(scope="module")
def cuda_kill(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.integration import test_inplace_worker_kill as cpu
    from tests.integration.launcher_scripts.harness import etcd_or_skip

    etcd: Any = etcd_or_skip(request)
    yield from cpu._scenario(tmp_path_factory.mktemp("cuda-inplace-kill"), etcd.endpoint,
                             worker_args=("--device", "cuda"))


@pytest.mark.etcd
@pytest.mark.timeout(240)
def test_cuda_training_heals_a_killed_worker_in_place_and_matches_the_undisturbed_run(
    cuda_kill: Any,
) -> None:
    # Two elastic-run agents, one worker each, both on this GPU (gloo between them); one
    # worker is SIGKILLed mid-step. The checks are the CPU test's, on CUDA state.
    from tests.integration import test_inplace_worker_kill as cpu

    for job in (cuda_kill.job, cuda_kill.steady):
        devices = {g["device"] for g in job.audit().gens}
        assert devices and all(d.startswith("cuda") for d in devices), devices
    cpu.test_survivor_keeps_its_process_and_the_weights_match_the_undisturbed_run(cuda_kill)
    cpu.test_the_replacement_is_healed_by_the_survivor_without_reading_storage(cuda_kill)
    cpu.test_at_most_one_step_is_redone_and_every_sample_is_trained_once(cuda_kill)


# ------------------------------------------------------------------------------ NCCL abort


@pytest.mark.timeout(180)
def test_an_nccl_world_is_aborted_from_a_thread_inside_a_collective_and_rebuilt() -> None:
    if not dist.is_nccl_available():
        pytest.skip("this torch has CUDA but no NCCL")
    # In a child process, so that a watchdog tearing the process down fails this test
    # instead of ending pytest: the child must exit 0 after both rebuilds.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("ELASTIC_MODE", None)  # in place: TORCH_NCCL_ASYNC_ERROR_HANDLING=0
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    child = [sys.executable, str(Path(__file__).with_name("nccl_abort_child.py"))]
    try:
        done = subprocess.run(child, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=150)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        pytest.fail(f"the child hung for 150 s (a wait that the abort never released?):\n"
                    f"{err[-4000:]}")
    print(done.stderr[-4000:], file=sys.stderr)
    assert done.returncode == 0, f"the child exited with {done.returncode}:\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("NCCL abort inside a collective:", json.dumps(result, indent=1))
    assert result["error_handling"] == "0"
    # The default fence: the host waited, and the step of the aborted world was refused.
    assert result["wait"]["refused"].startswith("WorldAbortedError: world epoch 1 was aborted")
    # The fence that waits for nothing: the unfinished step it let through is noted.
    assert result["later"]["spoiled"] is True
    # Each rebuilt world works: a world of one all-reduces to its own values.
    assert result["wait"]["rebuilt_sum"] == result["later"]["rebuilt_sum"] == 3.0
    # The device gate: queued without a host wait, skipped on the GPU, rewound to, and the
    # next world's step applied.
    gate = result["device"]
    assert gate["host_queued_s"] < 1.0  # the GPU still ran its 3 s sleep
    assert gate["skipped"] is True and gate["rewind_point"] == "step 7"
    assert gate["spoiled"] is False and gate["found_inf_left"] is False
    assert gate["applied_in_the_next_world"] is True
