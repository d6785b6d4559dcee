"""The trainer's GPU paths on the test's device: packed == padded gradients on every attention implementation
available there (sdpa / eager: block-diagonal mask, `packed_attention="mask"`; per-sequence SDPA,
`packed_attention="sdpa_varlen"`; CUDA: flex attention, flash-attention-2 when installed, and the automatic move
of an sdpa model to one of them), Liger's body kernels against the unfused body (CUDA), and bf16 mixed precision
against fp32.

Packed vs padded is judged against the rounding of the padded path itself (`_packed_noise`): the packed
gradients' distance to a float64 eager reference on the same device at most K = 2 times the padded gradients';
a failure states both distances, the packed-vs-padded one and the worst parameter. (The former fixed tolerance,
max |Δ| / max |g| <= 1.5e-2 per parameter in bf16, is at the bf16 noise floor: on the CPU the padded bf16
gradients of this model are 2.2e-2 to 3.8e-2 from float64 by that measure, two correct padded paths (sdpa and
eager) 1.4e-2 to 2.2e-2 apart, per-sequence SDPA's packed ones 1.6e-2 from padded.)

The models have head_dim 16 (`NARROWEST`): flex attention's CUDA kernel refuses head dimensions below 16
(PyTorch's lowering raises "NYI: embedding dimension ... at least 16"), and the tests' former head_dim 8
(hidden 32 / 4 heads) is why `[cuda-flex]` and `[cuda-sdpa-auto]` (auto moved the model to flex) failed on the
H200; auto now keeps such a model off flex (`packing.flex_runs_on_cuda`)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from _gpu import CUDA_ONLY, DEVICES, on
from _packed_noise import assert_within_noise, float64_reference, layout_grads
from _trainer_fixtures import make_items
from test_packed_attention import WINDOW, _model

FLASH = importlib.util.find_spec("flash_attn") is not None
#: the smallest head dimension every CUDA attention kernel here takes (flex's needs >= 16)
NARROWEST = {"head_dim": 16}
ATTENTION = [
    on("cpu", "sdpa", id="cpu-sdpa"), on("cpu", "eager", id="cpu-eager"),
    on("cuda", "sdpa", id="cuda-sdpa"), on("cuda", "eager", id="cuda-eager"),
    on("cpu", "sdpa_varlen", id="cpu-sdpa-varlen"), on("cuda", "sdpa_varlen", id="cuda-sdpa-varlen"),
    on("cpu", "sdpa_varlen-window", id="cpu-sdpa-varlen-window"),
    on("cuda", "sdpa_varlen-window", id="cuda-sdpa-varlen-window"),
    on("cuda", "flex_attention", id="cuda-flex"),
    pytest.param("cuda", "flash_attention_2", id="cuda-flash2",
                 marks=(*CUDA_ONLY, pytest.mark.skipif(not FLASH, reason="needs flash-attn"))),
    on("cuda", "auto", id="cuda-sdpa-auto"),
]


def _reference(model, items, device: str) -> dict[str, torch.Tensor]:
    """Gradients of the padded layout in float64 on eager attention, on `device`."""
    return layout_grads(float64_reference(model), items, device, layout="padded", body_kernels=False)


def _close(got: dict, want: dict, tol: float) -> None:
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        assert err <= tol, f"{name}: max |got - want| / max |want| = {err:.3e} > {tol}"


@pytest.mark.parametrize(("device", "attn"), ATTENTION)
def test_packed_equals_padded(device, attn):
    """Several micro-batches; bf16 weights on CUDA (flash-attention needs half precision), fp32 on the CPU.
    `sdpa_varlen-window`: a sliding window of 8 tokens on every layer, binding in the longer sequences (on CUDA
    the flash varlen kernel's window_size)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    window = WINDOW if attn.endswith("-window") else {}
    attn = attn.removesuffix("-window")
    model = _model("qwen2", "sdpa" if attn in ("auto", "sdpa_varlen") else attn, **NARROWEST, **window)
    model = model.to(device=device, dtype=dtype)
    items = make_items(8, seed=7)
    if window:
        assert max(len(it.input_ids) for it in items) > WINDOW["sliding_window"]
    how = "auto" if attn in ("auto", "flex_attention", "flash_attention_2") else "mask"
    how = "sdpa_varlen" if attn == "sdpa_varlen" else how
    grads = {layout: layout_grads(copy.deepcopy(model), items, device, layout=layout, body_kernels=False,
                                  packed_attention=how) for layout in ("padded", "packed")}
    ref = _reference(model, items, device)
    assert_within_noise(grads["packed"], grads["padded"], ref, f"{device} {attn} ({how}) {dtype}")


@pytest.mark.parametrize(("device", "attn"), [on("cpu", "sdpa", id="cpu-sdpa"), on("cuda", "sdpa", id="cuda-sdpa"),
                                              *[p for p in ATTENTION if p.id == "cuda-flash2"]])
def test_packed_equals_padded_under_bf16_mixed_precision(device, attn):
    """fp32 master weights, bf16 autocast (the CLI's --dtype bf16; flash-attention runs only so): the trainer's
    packed-attention probe runs under the same autocast, and packed gradients match padded ones."""
    model = _model("qwen2", attn, **NARROWEST).to(device)
    items = make_items(8, seed=10)
    how = "auto" if attn == "flash_attention_2" else "mask"
    cfg = {"body_kernels": False, "mixed_precision_dtype": "bf16", "packed_attention": how}
    grads = {layout: layout_grads(copy.deepcopy(model), items, device, layout=layout, **cfg)
             for layout in ("padded", "packed")}
    ref = _reference(model, items, device)
    assert_within_noise(grads["packed"], grads["padded"], ref, f"{device} {attn} ({how}) bf16 autocast")


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("device", [on("cuda", id="cuda")])
def test_body_kernels_match_the_unfused_body(device, layout):
    """fp32 Llama and Qwen2: Liger's RMSNorm / RoPE / SwiGLU give the unfused body's gradients, in both layouts
    (packed: RoPE of restarting positions in one row, the ours-packed+kernels path)."""
    items = make_items(6, seed=8)
    for arch in ("llama", "qwen2"):
        model = _model(arch, "sdpa").to(device)
        plain = layout_grads(copy.deepcopy(model), items, device, body_kernels=False, layout=layout)
        fused = layout_grads(copy.deepcopy(model), items, device, body_kernels=True, layout=layout)
        _close(fused, plain, 1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_mixed_precision_is_close_to_fp32(device):
    items = make_items(6, seed=9)
    model = _model("llama", "sdpa")
    fp32 = layout_grads(copy.deepcopy(model), items, device, body_kernels=False)
    bf16 = layout_grads(copy.deepcopy(model), items, device, body_kernels=False, mixed_precision_dtype="bf16")
    num = sum(float((bf16[n] - g).norm() ** 2) for n, g in fp32.items()) ** 0.5
    den = sum(float(g.norm() ** 2) for g in fp32.values()) ** 0.5
    assert num / den < 5e-2
