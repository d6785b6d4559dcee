"""The torch backend under `torch.compile` with bf16 operands on CUDA: its gradient GEMMs keep bf16 operands
with fp32 outputs (`torch_head.addmm_acc_`), whose `addmm(..., out_dtype=)` torch < 2.12 cannot trace
(FakeTensor); while compiling they go through `mm(..., out_dtype=)`. The compiled calls equal the eager ones.
The CPU variant runs the same bodies in fp32 (on the CPU the torch backend upcasts: nothing to trace there)."""

from __future__ import annotations

import pytest
import torch
from _gpu import on
from _head_calls import batch_and_leaves, calls

CASES = calls("torch")


@pytest.mark.parametrize("name", ["head", "cispo-fused", "cispo-generic"])
@pytest.mark.parametrize("device,dtype", [on("cpu", torch.float32, id="cpu-fp32"),
                                          on("cuda", torch.bfloat16, id="cuda-bf16")])
def test_torch_backend_compiled_equals_eager(device, dtype, name):
    fn = CASES[name]
    batch, leaves = batch_and_leaves(device)
    leaves = [x.detach().to(dtype).requires_grad_() for x in leaves]
    want = fn(*leaves, batch)
    want_grads = torch.autograd.grad(want, leaves)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=False)(*leaves, batch)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
