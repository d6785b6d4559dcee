"""Device parameters and per-dtype tolerances of the GPU suite.

Tolerances (ours vs `ludic_fast.reference` in float64 on the exact float64 images of the inputs):
  outputs (logprob, entropy, lse, losses, fp32 statistics): |ours - ref| <= OUT * (1 + |ref|), every dtype;
  gradients (dh, dW, db, in the input dtype): max |ours - ref| / max |ref| <= GRAD[dtype]. fp32 keeps its
  rounding far below that; bf16 / fp16 round d(raw) to the input dtype before the gradient GEMMs (the
  tensor-core operands, as every fused peer does) and round the gradients themselves (bf16: 2^-9 relative).
The torch backend (CPU variants) multiplies bf16 in bf16 and rounds each chunk's logits, so its bf16
outputs carry up to 2^-8 |z| of error: the CPU variants run fp32 only."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
NO_CUDA = "needs CUDA: torch.cuda.is_available() is False on this machine"
CUDA_ONLY = (pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA))

OUT_TOL = 2e-5
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2, torch.float16: 1.5e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def on(device: str, *values, id: str | None = None):
    """A pytest.param whose first value is `device`; the CUDA ones carry the gpu mark and the CUDA skip."""
    return pytest.param(device, *values, marks=CUDA_ONLY if device == "cuda" else (), id=id)


DEVICES = [on("cpu", id="cpu"), on("cuda", id="cuda")]


def close_outputs(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """|got - want| <= OUT_TOL (1 + |want|), elementwise (both moved to float64 on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = (got - want).abs() > OUT_TOL * (1 + want.abs())
    assert not bool(bad.any()), (what, float((got - want).abs().max()))


def grad_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (float64 on the CPU)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30)) if want.numel() else 0.0
