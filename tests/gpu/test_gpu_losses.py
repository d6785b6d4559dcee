"""Every loss of `ludic_fast.losses` (the RL losses and the preference losses it re-exports) x {fused, generic}
x {padded, packed} on the test's device (backend auto: triton on CUDA) against its reference twin on
materialised float64 logits; `linear_cross_entropy`; and CISPO /
token-clipped PPO at a real vocabulary (V=151936, bf16) on CUDA. Tolerances: `_gpu` (fp32 gradients 1e-4
relative; losses and statistics OUT_TOL)."""

from __future__ import annotations

import pytest
import torch
from _gpu import GRAD_TOL, close_outputs, grad_err, on
from test_losses_common import CASES, make_batch, rel_err, to_packed
from test_preference import CASES as PREFERENCE_CASES
from test_preference import CHUNKS as PREFERENCE_CHUNKS
from test_preference import make_pairs

from ludic_fast import linear_cross_entropy
from ludic_fast import losses as L
from ludic_fast import reference as R

# 16 whole vocabulary rows per chunk (the fewest the triton fused-loss path takes whole rows at; below that it
# slices the vocabulary on torch ops): several chunks per call
CHUNK = 16 * 37
LOSS_TOL = 1e-5  # relative, fp32 (as tests/test_losses_parity.py)


def _on(device: str, batch: dict, *leaves):
    moved = [x.detach().to(device).requires_grad_() for x in leaves]
    return {k: v.to(device) for k, v in batch.items()}, moved


def _params():
    out = []
    for device in ("cpu", "cuda"):
        out += [on(device, case, path, layout, id=f"{device}-{case[0]}-{path}-{layout}")
                for case in CASES for path in ("fused", "generic") for layout in ("padded", "packed")]
    return out


@pytest.mark.parametrize("device,case,path,layout", _params())
def test_loss_matches_reference(device, case, path, layout):
    _, ours_fn, ref_fn = case
    batch, h, W, b = make_batch(0)
    ref_loss, ref_stats = ref_fn(batch, logits=R.head_logits(h.double(), W.double(), b.double()))
    ref_grads = torch.autograd.grad(ref_loss, (h, W, b))
    batch_d, (hd, Wd, bd) = _on(device, batch, h, W, b)
    if layout == "packed":
        batch_d, h_in = to_packed(batch_d, hd)
        batch_d["cu_seqlens"] = batch_d["cu_seqlens"].to(device)
    else:
        h_in = hd
    loss, stats = ours_fn(batch_d, hidden=h_in, weight=Wd, bias=bd, fused=path == "fused", chunk_elements=CHUNK)
    grads = torch.autograd.grad(loss, (hd, Wd, bd))
    assert loss.device.type == device
    assert rel_err(loss.cpu(), ref_loss) <= LOSS_TOL, (float(loss), float(ref_loss))
    for k, v in ref_stats.items():
        if isinstance(v, torch.Tensor):
            assert abs(float(stats[k]) - float(v)) <= LOSS_TOL * max(1.0, abs(float(v))), (k, stats[k], v)
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.device.type == device and grad_err(g, rg) <= GRAD_TOL[torch.float32], (name, grad_err(g, rg))


def _preference_params():
    return [on(device, case, path, layout, id=f"{device}-{case[0]}-{path}-{layout}") for device in ("cpu", "cuda")
            for case in PREFERENCE_CASES for path in ("fused", "generic") for layout in ("padded", "packed")]


@pytest.mark.parametrize("device,case,path,layout", _preference_params())
def test_preference_loss_matches_reference(device, case, path, layout):
    name, ours_fn, ref_fn = case
    batch, h, W, b = make_pairs(0, kto=name.startswith("kto"))
    ref_loss, ref_stats = ref_fn(batch, logits=R.head_logits(h.double(), W.double(), b.double()))
    ref_grads = torch.autograd.grad(ref_loss, (h, W, b))
    batch_d, (hd, Wd, bd) = _on(device, batch, h, W, b)
    h_in = hd
    if layout == "packed":
        batch_d, h_in = to_packed(batch_d, hd)
        batch_d["cu_seqlens"] = batch_d["cu_seqlens"].to(device)
    loss, stats = ours_fn(batch_d, hidden=h_in, weight=Wd, bias=bd, fused=path == "fused",
                          chunk_elements=PREFERENCE_CHUNKS["one_pass"])
    grads = torch.autograd.grad(loss, (hd, Wd, bd))
    assert loss.device.type == device and rel_err(loss.cpu(), ref_loss) <= LOSS_TOL, (float(loss), float(ref_loss))
    for k, v in ref_stats.items():
        assert abs(float(stats[k]) - float(v)) <= LOSS_TOL * max(1.0, abs(float(v))), (k, stats[k], v)
    for gname, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert grad_err(g, rg) <= GRAD_TOL[torch.float32], (gname, grad_err(g, rg))


@pytest.mark.parametrize("device", [on("cpu", id="cpu"), on("cuda", id="cuda")])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy(device, reduction):
    g = torch.Generator().manual_seed(4)
    n, v, d = (4096, 151936, 64) if device == "cuda" else (40, 1021, 24)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / d**0.5
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    # the float64 reference on the same device (4096 x 151936 float64 logits on CUDA)
    h64, w64 = (x.double().to(device).requires_grad_() for x in (h, w))
    ref = R.linear_cross_entropy(h64, w64, y.to(device), reduction=reduction)
    hd, wd = (x.to(device).requires_grad_() for x in (h, w))
    got = linear_cross_entropy(hd, wd, y.to(device), reduction=reduction)
    close_outputs(got, ref, f"cross-entropy ({reduction})")
    upstream = torch.randn(got.shape, generator=g)
    ref_grads = torch.autograd.grad(ref, (h64, w64), upstream.double().to(device))
    grads = torch.autograd.grad(got, (hd, wd), upstream.to(device))
    for name, gg, rg in zip(("hidden", "weight"), grads, ref_grads):
        assert grad_err(gg, rg) <= GRAD_TOL[torch.float32], (name, grad_err(gg, rg))


@pytest.mark.parametrize("path,strategy", [("fused", "auto"), ("fused", "workspace"), ("fused", "fused"),
                                           ("generic", "auto")])
@pytest.mark.parametrize("name", ["cispo", "token_clipped"])
@pytest.mark.parametrize("device", [on("cuda", id="cuda")])
def test_rl_loss_at_a_real_vocabulary_bf16(device, name, path, strategy, monkeypatch):
    """B=4 sequences of 1024 tokens, D=256, V=151936, bf16 hidden and weight at the default budget, each
    triton strategy forced in fused-loss mode (LUDIC_FAST_TRITON_STRATEGY), against the reference on the
    float64 images."""
    monkeypatch.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
    g = torch.Generator().manual_seed(2)
    B, T, D, V = 4, 1024, 256, 151936
    h = (torch.randn(B, T, D, generator=g)).to(torch.bfloat16)
    W = (torch.randn(V, D, generator=g) * 2 / D**0.5).to(torch.bfloat16)
    ids = torch.randint(0, V, (B, T), generator=g)
    amask = torch.zeros(B, T)
    amask[:, T // 4:] = 1
    with torch.no_grad():
        lp = torch.zeros(B, T, dtype=torch.float64)
        lp[:, 1:] = R.compute_token_logp(R.head_logits(h.double().to(device), W.double().to(device)),
                                         ids.to(device)).cpu()
    actor = ((lp + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)) * amask).float()
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long), "action_mask": amask,
             "weight": torch.randn(B, generator=g), "actor_logps": actor, "old_logp_action": actor.sum(1)}
    ours_fn, ref_fn = {"cispo": (L.CISPOLoss(), R.CISPOLoss()),
                       "token_clipped": (L.TokenClippedSurrogateLoss(), R.TokenClippedSurrogateLoss())}[name]
    batch_d = {k: v.to(device) for k, v in batch.items()}
    h64, W64 = (x.double().to(device).requires_grad_() for x in (h, W))
    ref_loss, _ = ref_fn(batch_d, logits=R.head_logits(h64, W64))
    ref_grads = torch.autograd.grad(ref_loss, (h64, W64))
    hd, Wd = (x.to(device).requires_grad_() for x in (h, W))
    loss, _ = ours_fn(batch_d, hidden=hd, weight=Wd, fused=path == "fused")
    grads = torch.autograd.grad(loss, (hd, Wd))
    close_outputs(loss, ref_loss, "loss")
    for gname, gg, rg in zip(("hidden", "weight"), grads, ref_grads):
        assert gg.dtype == torch.bfloat16 and grad_err(gg, rg) <= GRAD_TOL[torch.bfloat16], (gname, grad_err(gg, rg))
