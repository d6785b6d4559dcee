"""The head op (`linear_logprobs`, backend auto: triton on CUDA, torch on CPU) against the float64 reference:
fp32 / bf16 / fp16, V in {1021, 50257, 151936}, N from 1 to 16384, N*V > 2^31, every head option (softcap,
scalar and per-token temperature, logit_scale, bias, ignore_index, strided inputs, entropy off, frozen
weight), each triton strategy forced and auto. The CPU variants run the fp32 cases at small shapes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from _gpu import DTYPES, GRAD_TOL, close_outputs, grad_err, on
from _head_grads import head_and_grads

from ludic_fast import reference
from ludic_fast.ops import linear_logprobs


@dataclass(frozen=True)
class Case:
    n: int
    v: int
    d: int
    dtype: str = "fp32"
    softcap: float | None = None
    temperature: str = "1"  # "1", "0.7" or "per-token"
    logit_scale: float = 1.0
    bias: bool = False
    ignore: bool = False  # every 7th row is ignore_index
    strided: bool = False  # hidden a strided view, weight column-major
    entropy: bool = True
    frozen_weight: bool = False  # weight.requires_grad False: dh (and db) only

    @property
    def id(self) -> str:
        flags = [k for k in ("bias", "ignore", "strided", "frozen_weight") if getattr(self, k)]
        flags += [] if self.entropy else ["no_entropy"]
        flags += [] if self.softcap is None else [f"softcap{self.softcap:g}"]
        flags += [] if self.temperature == "1" else [f"T{self.temperature}"]
        flags += [] if self.logit_scale == 1.0 else [f"scale{self.logit_scale:g}"]
        return "-".join([self.dtype, f"n{self.n}", f"v{self.v}", f"d{self.d}", *flags])


STRATEGIES = ("auto", "fused", "workspace")
SIZES = [Case(n, v, 128, dt) for dt in DTYPES for v in (1021, 50257, 151936) for n in (1, 300, 4096)]
SIZES += [Case(16384, v, 128, "bf16") for v in (1021, 50257)]
OPTION = Case(300, 50257, 72)  # D not a multiple of the K block
OPTIONS = [
    replace(OPTION, softcap=5.0),
    replace(OPTION, temperature="0.7"),
    replace(OPTION, temperature="per-token"),
    replace(OPTION, logit_scale=1.3),
    replace(OPTION, bias=True),
    replace(OPTION, ignore=True),
    replace(OPTION, strided=True),
    replace(OPTION, entropy=False),
    replace(OPTION, frozen_weight=True),
    replace(OPTION, softcap=3.0, temperature="per-token", logit_scale=0.8, bias=True, ignore=True, strided=True),
]
OPTIONS += [replace(c, dtype="bf16") for c in OPTIONS]
# on the CPU (torch backend): fp32, small shapes, every option
CPU_CASES = [Case(n, 1021, 72) for n in (1, 37)] + [replace(c, n=37, v=1021) for c in OPTIONS if c.dtype == "fp32"]


def _params():
    out = [on("cpu", c, "auto", id=f"cpu-{c.id}") for c in CPU_CASES]
    out += [on("cuda", c, s, id=f"cuda-{c.id}-{s}") for c in SIZES + OPTIONS for s in STRATEGIES]
    return out


def make_inputs(case: Case, device: str, seed: int = 0):
    """hidden, weight, bias, targets, temperature, g_lp, g_h of one case, all on `device` (drawn on the CPU;
    strided views are taken on `device`)."""
    g = torch.Generator().manual_seed(seed)
    n, v, d, dt = case.n, case.v, case.d, DTYPES[case.dtype]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

    hidden = rnd(n, 2 * d)[:, ::2] if case.strided else rnd(n, d)
    weight = rnd(d, v, scale=2.0 / d**0.5).T if case.strided else rnd(v, d, scale=2.0 / d**0.5)
    bias = rnd(v, scale=0.5) if case.bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    if case.ignore:
        targets[1::7] = -100
    temperature = {"1": 1.0, "0.7": 0.7, "per-token": (torch.rand(n, generator=g) + 0.4).to(device)}[case.temperature]
    g_lp = torch.randn(n, generator=g).to(device)
    g_h = torch.randn(n, generator=g).to(device) if case.entropy else None
    return hidden, weight, bias, targets.to(device), temperature, g_lp, g_h


def _f64(x):
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def check_against_reference(case: Case, device: str, seed: int = 0) -> None:
    hidden, weight, bias, targets, temperature, g_lp, g_h = make_inputs(case, device, seed)
    assert hidden.is_contiguous() != case.strided and weight.is_contiguous() != case.strided
    out, grads = head_and_grads(linear_logprobs, case, hidden, weight, bias, targets, temperature, g_lp, g_h)
    ref_case = replace(case, strided=False)
    ref, ref_grads = head_and_grads(reference.linear_logprobs, ref_case, *(_f64(x) for x in (hidden, weight, bias)),
                                    targets, _f64(temperature), _f64(g_lp), _f64(g_h))
    assert out.logprobs.dtype == torch.float32 and out.logprobs.device == hidden.device
    close_outputs(out.logprobs, ref.logprobs, "logprobs")
    close_outputs(out.lse, ref.lse, "lse")
    if case.entropy:
        close_outputs(out.entropy, ref.entropy, "entropy")
    else:
        assert out.entropy is None
    assert bool((out.logprobs[targets == -100] == 0).all())
    names = ["hidden"] + ([] if case.frozen_weight else ["weight"]) + (["bias"] if case.bias else [])
    assert len(grads) == len(names)
    for name, got, want in zip(names, grads, ref_grads):
        assert got.dtype == DTYPES[case.dtype] and got.shape == want.shape, name
        err = grad_err(got, want)
        assert err <= GRAD_TOL[DTYPES[case.dtype]], (name, err)


@pytest.mark.parametrize("device,case,strategy", _params())
def test_head_matches_reference(device, case, strategy, monkeypatch):
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    check_against_reference(case, device)


@pytest.mark.parametrize("device,strategy", [on("cpu", "auto", id="cpu")]
                         + [on("cuda", s, id=f"cuda-{s}") for s in STRATEGIES])
def test_more_than_2_to_the_31_logits(device, strategy, monkeypatch):
    """N * V > 2^31 (int32 offsets would wrap): on CUDA N=16384, V=151936. Upstream gradients are nonzero
    on the first and last 64 rows only, so the float64 reference on those rows gives every output there, dh
    there (zero elsewhere) and the whole dW, without materialising 2.5e9 reference logits."""
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    n, v = (16384, 151936) if device == "cuda" else (300, 1021)
    assert device == "cpu" or n * v > 2**31
    case = Case(n, v, 64, "bf16" if device == "cuda" else "fp32", bias=True)
    hidden, weight, bias, targets, _, g_lp, g_h = make_inputs(case, device, seed=1)
    rows = torch.cat([torch.arange(64), torch.arange(n - 64, n)]).to(device)
    keep = torch.zeros(n, dtype=torch.bool, device=device)
    keep[rows] = True
    g_lp, g_h = g_lp * keep, g_h * keep
    out, (dh, dw, db) = head_and_grads(linear_logprobs, case, hidden, weight, bias, targets, 1.0, g_lp, g_h)
    assert bool(torch.isfinite(out.lse).all())
    ref, (ref_dh, ref_dw, ref_db) = head_and_grads(reference.linear_logprobs, case, _f64(hidden[rows]), _f64(weight),
                                                   _f64(bias), targets[rows], 1.0, _f64(g_lp[rows]),
                                                   _f64(g_h[rows]))
    for name, got, want in (("logprobs", out.logprobs, ref.logprobs), ("entropy", out.entropy, ref.entropy),
                            ("lse", out.lse, ref.lse)):
        close_outputs(got[rows], want, name)
    assert not bool(dh[~keep].any()), "rows without upstream gradient must get dh = 0"
    tol = GRAD_TOL[DTYPES[case.dtype]]
    for name, got, want in (("hidden", dh[rows], ref_dh), ("weight", dw, ref_dw), ("bias", db, ref_db)):
        assert grad_err(got, want) <= tol, (name, grad_err(got, want))


@pytest.mark.parametrize("device", [on("cpu", id="cpu"), on("cuda", id="cuda")])
def test_auto_backend_is_triton_on_cuda(device, monkeypatch):
    """backend='auto' runs the triton kernels on CUDA tensors (the row kernel is entered), torch on CPU."""
    from ludic_fast.ops import triton_head

    calls = []
    original = triton_head.triton_linear_logprobs
    monkeypatch.setattr(triton_head, "triton_linear_logprobs", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    hidden, weight, _, targets, _, _, _ = make_inputs(Case(8, 1021, 64), device)
    linear_logprobs(hidden, weight, targets)
    assert len(calls) == (1 if device == "cuda" else 0)


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices: torch.cuda.device_count() < 2 on this machine")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inputs_on_a_device_that_is_not_current(strategy, monkeypatch):
    """Triton launches on the current device: with cuda:0 current and every input on the last device, the
    kernels must still run there (the launchers enter the inputs' device) and match the reference."""
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    other = f"cuda:{torch.cuda.device_count() - 1}"
    with torch.cuda.device(0):
        check_against_reference(Case(300, 50257, 72, "bf16", bias=True), other)
