"""Every Triton launcher enters the device of its tensors before the launch (triton launches on the current CUDA
device, so inputs on cuda:1 need it): the head op (both strategies, forward and backward) and the distillation
divergence reach all five launchers, each of which must call its `on_device_of` with a tensor on the inputs'
device."""

from __future__ import annotations

import torch
from _interp import DEVICE, MARKS
from ludic_fast.kernels import divergence_rows, head_fwd, head_grad, head_merge, head_rows

from ludic_fast import linear_divergence
from ludic_fast.ops import linear_logprobs

pytestmark = MARKS

LAUNCHERS = {m.__name__.rsplit(".", 1)[1]: m for m in (head_fwd, head_grad, head_merge, head_rows, divergence_rows)}


def test_every_launcher_enters_the_inputs_device(monkeypatch):
    entered: dict[str, list[torch.device]] = {name: [] for name in LAUNCHERS}
    for name, module in LAUNCHERS.items():
        original = module.on_device_of

        def spy(t, name=name, original=original):
            entered[name].append(t.device)
            return original(t)

        monkeypatch.setattr(module, "on_device_of", spy)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 40, generator=g).to(DEVICE).requires_grad_(True)
    w = (torch.randn(1021, 40, generator=g) * 0.3).to(DEVICE).requires_grad_(True)
    targets = torch.randint(0, 1021, (5,), generator=g).to(DEVICE)
    for strategy in ("fused", "workspace"):
        monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
        out = linear_logprobs(h, w, targets, backend="triton")
        (out.logprobs.sum() + out.entropy.sum()).backward()
    teacher_h, teacher_w = torch.randn(5, 24, generator=g).to(DEVICE), torch.randn(1021, 24, generator=g).to(DEVICE)
    linear_divergence(h, w, teacher_h, teacher_w, targets, backend="triton").backward()
    for name, devices in entered.items():
        assert devices, f"{name}'s launcher did not enter its tensors' device"
        assert all(d == h.device for d in devices), (name, devices)

