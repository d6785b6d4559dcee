"""The trainer's GPU paths on the test's device: packed == padded gradients on every attention implementation
available there (sdpa / eager: block-diagonal mask, `packed_attention="mask"`; per-sequence SDPA,
`packed_attention="sdpa_varlen"`; CUDA: flex attention, flash-attention-2 when installed, and the automatic move
of an sdpa model to one of them),
Liger's body kernels against the unfused body (CUDA), and bf16 mixed precision against fp32."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from _gpu import CUDA_ONLY, DEVICES, GRAD_TOL, on
from _trainer_fixtures import ListSource, make_items
from test_packed_attention import _model

from ludic_fast.algorithm import make_cispo
from ludic_fast.data.types import SAWBatch
from ludic_fast.trainer import Trainer, TrainerConfig

FLASH = importlib.util.find_spec("flash_attn") is not None
ATTENTION = [
    on("cpu", "sdpa", id="cpu-sdpa"), on("cpu", "eager", id="cpu-eager"),
    on("cuda", "sdpa", id="cuda-sdpa"), on("cuda", "eager", id="cuda-eager"),
    on("cpu", "sdpa_varlen", id="cpu-sdpa-varlen"), on("cuda", "sdpa_varlen", id="cuda-sdpa-varlen"),
    on("cuda", "flex_attention", id="cuda-flex"),
    pytest.param("cuda", "flash_attention_2", id="cuda-flash2",
                 marks=(*CUDA_ONLY, pytest.mark.skipif(not FLASH, reason="needs flash-attn"))),
    on("cuda", "auto", id="cuda-sdpa-auto"),
]


def _grads(model, items, device: str, **cfg) -> dict[str, torch.Tensor]:
    trainer = Trainer(model=model, algo=make_cispo(group_size=1), batch_source=ListSource([items]),
                      cfg=TrainerConfig(model_device=device, pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                                        micro_token_budget=48, **cfg))
    trainer.accumulate_gradients(SAWBatch(items=list(items)))
    return {n: p.grad.float() for n, p in trainer.model.named_parameters()}


def _close(got: dict, want: dict, tol: float) -> None:
    for name, g in want.items():
        err = float((got[name] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        assert err <= tol, (name, err)


@pytest.mark.parametrize(("device", "attn"), ATTENTION)
def test_packed_equals_padded(device, attn):
    """Several micro-batches; bf16 weights on CUDA (flash-attention needs half precision), fp32 on the CPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = _model("qwen2", "sdpa" if attn in ("auto", "sdpa_varlen") else attn).to(device=device, dtype=dtype)
    items = make_items(8, seed=7)
    how = "auto" if attn in ("auto", "flex_attention", "flash_attention_2") else "mask"
    how = "sdpa_varlen" if attn == "sdpa_varlen" else how
    grads = {layout: _grads(copy.deepcopy(model), items, device, layout=layout, body_kernels=False,
                            packed_attention=how) for layout in ("padded", "packed")}
    _close(grads["packed"], grads["padded"], GRAD_TOL[dtype])


@pytest.mark.parametrize(("device", "attn"), [on("cpu", "sdpa", id="cpu-sdpa"), on("cuda", "sdpa", id="cuda-sdpa"),
                                              *[p for p in ATTENTION if p.id == "cuda-flash2"]])
def test_packed_equals_padded_under_bf16_mixed_precision(device, attn):
    """fp32 master weights, bf16 autocast (the CLI's --dtype bf16; flash-attention runs only so): the trainer's
    packed-attention probe runs under the same autocast, and packed gradients match padded ones."""
    model = _model("qwen2", attn).to(device)
    items = make_items(8, seed=10)
    how = "auto" if attn == "flash_attention_2" else "mask"
    grads = {layout: _grads(copy.deepcopy(model), items, device, layout=layout, body_kernels=False,
                            mixed_precision_dtype="bf16", packed_attention=how) for layout in ("padded", "packed")}
    _close(grads["packed"], grads["padded"], GRAD_TOL[torch.bfloat16])


@pytest.mark.parametrize("device", [on("cuda", id="cuda")])
def test_body_kernels_match_the_unfused_body(device):
    """fp32 Llama and Qwen2: Liger's RMSNorm / RoPE / SwiGLU give the unfused body's gradients."""
    items = make_items(6, seed=8)
    for arch in ("llama", "qwen2"):
        model = _model(arch, "sdpa").to(device)
        plain = _grads(copy.deepcopy(model), items, device, body_kernels=False)
        fused = _grads(copy.deepcopy(model), items, device, body_kernels=True)
        _close(fused, plain, 1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_mixed_precision_is_close_to_fp32(device):
    items = make_items(6, seed=9)
    model = _model("llama", "sdpa")
    fp32 = _grads(copy.deepcopy(model), items, device, body_kernels=False)
    bf16 = _grads(copy.deepcopy(model), items, device, body_kernels=False, mixed_precision_dtype="bf16")
    num = sum(float((bf16[n] - g).norm() ** 2) for n, g in fp32.items()) ** 0.5
    den = sum(float(g.norm() ** 2) for g in fp32.values()) ** 0.5
    assert num / den < 5e-2
