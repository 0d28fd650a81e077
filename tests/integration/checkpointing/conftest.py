from __future__ import annotations

import torch


def make_model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optim


def train_steps(model: torch.nn.Module, optim: torch.optim.Optimizer, n: int) -> None:
    for i in range(n):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(5, 8, generator=g)
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def flat_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for pid, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            out[f"o.{pid}.{k}"] = torch.as_tensor(v).clone()
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
