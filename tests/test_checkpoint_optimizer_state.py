"""An optimizer whose state holds non-tensor values (step counters, floats, flags: as LBFGS or a custom
optimizer keeps) comes back whole from a checkpoint round trip, and steps on exactly as before it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ludic_fast.run.checkpoint import CheckpointConfig, CheckpointManager


class CountingMomentum(torch.optim.Optimizer):
    """p -= lr m / count, m = 0.5 m + g: the state mixes a tensor (m) with an int, a float and a bool."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(m=torch.zeros_like(p), count=0, largest=0.0, warmed=False)
                st["m"].mul_(0.5).add_(p.grad)
                st["count"] += 1
                st["largest"] = max(st["largest"], float(p.grad.abs().max()))
                st["warmed"] = st["count"] >= 2
                scale = 1.0 if st["warmed"] else 0.5
                p.sub_(group["lr"] * scale * st["m"] / (st["count"] * max(st["largest"], 1e-12)))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((2, 3), float(i + 1))).square().sum().backward()
        opt.step()


def test_non_tensor_optimizer_state_round_trips(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = CountingMomentum(model.parameters())
    _train(model, opt, 3)
    CheckpointManager(CheckpointConfig(str(tmp_path))).save(model, opt, step=3)

    fresh = nn.Linear(3, 2)
    fresh_opt = CountingMomentum(fresh.parameters())
    CheckpointManager(CheckpointConfig(str(tmp_path))).load(fresh, fresh_opt, step=3)
    for p, q in zip(opt.state.values(), fresh_opt.state.values()):
        assert set(p) == set(q) == {"m", "count", "largest", "warmed"}
        assert torch.equal(p["m"], q["m"])
        assert (q["count"], q["largest"], q["warmed"]) == (p["count"], p["largest"], p["warmed"])
        assert q["count"] == 3 and q["warmed"] is True
        assert type(q["count"]) is int and type(q["warmed"]) is bool
    _train(model, opt, 2)
    _train(fresh, fresh_opt, 2)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def _lbfgs_train(model: nn.Module, opt: torch.optim.LBFGS, steps: int) -> None:
    x = torch.arange(6.0).reshape(2, 3)

    def closure():
        opt.zero_grad()
        loss = (model(x) - 1.0).square().sum()
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)


def test_lbfgs_history_round_trips(tmp_path):
    """LBFGS keeps lists of tensors (old_dirs, old_stps, ro, al) beside ints and floats: saving failed with a
    JSON TypeError; now the history comes back and the next steps are identical."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
    _lbfgs_train(model, opt, 2)
    assert any(isinstance(v, list) and v for v in opt.state[opt.param_groups[0]["params"][0]].values())
    CheckpointManager(CheckpointConfig(str(tmp_path))).save(model, opt, step=2)

    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.LBFGS(fresh.parameters(), lr=0.5, max_iter=3, history_size=4)
    CheckpointManager(CheckpointConfig(str(tmp_path))).load(fresh, fresh_opt, step=2)
    _lbfgs_train(model, opt, 2)
    _lbfgs_train(fresh, fresh_opt, 2)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_unserialisable_state_is_named(tmp_path):
    model = nn.Linear(3, 2)
    opt = CountingMomentum(model.parameters())
    _train(model, opt, 1)
    next(iter(opt.state.values()))["bad"] = object()
    with pytest.raises(TypeError, match=r"optimizer state \[0\]\['bad'\] = object cannot be checkpointed"):
        CheckpointManager(CheckpointConfig(str(tmp_path))).save(model, opt, step=1)
