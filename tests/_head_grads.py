"""One head call and its gradients, shared by the GPU suite (tests/gpu) and the Triton interpreter tests
(tests/interpret)."""

from __future__ import annotations

import torch


def leaf(x: torch.Tensor, grad: bool = True) -> torch.Tensor:
    """A copy of x with x's strides (clone() would make a non-dense view contiguous)."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    return out.requires_grad_(grad)


def head_and_grads(fn, case, hidden, weight, bias, targets, temperature, g_lp, g_h):
    """`fn(hidden, weight, targets, bias=, ...)` (the head op or its reference) on fresh leaves with the inputs'
    strides, and the gradients of logprobs (upstream g_lp) and, with `case.entropy`, entropy (upstream g_h)
    w.r.t. hidden, weight (unless `case.frozen_weight`, where the case has that field) and bias (if any).
    `case` also gives logit_scale and softcap."""
    frozen = getattr(case, "frozen_weight", False)
    leaves = [leaf(hidden), leaf(weight, grad=not frozen)]
    b = None if bias is None else leaf(bias)
    out = fn(leaves[0], leaves[1], targets, bias=b, logit_scale=case.logit_scale, softcap=case.softcap,
             temperature=temperature, entropy=case.entropy)
    outputs, upstream = [out.logprobs], [g_lp]
    if case.entropy:
        outputs.append(out.entropy)
        upstream.append(g_h)
    wrt = [leaves[0]] + ([] if frozen else [leaves[1]]) + ([] if b is None else [b])
    return out, torch.autograd.grad(outputs, wrt, upstream)
