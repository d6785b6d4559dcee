"""Packed == padded in bf16 on every packed-attention path the CPU runs (the dense block-diagonal mask under
sdpa and eager, per-sequence SDPA; flex attention forward only), with bf16 weights and with fp32 weights under
bf16 autocast: the packed gradients' distance to a float64 reference is at most K times the padded ones'
(`_packed_noise`). The criterion catches a sequence attending its neighbour (planted by hand below)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from _packed_noise import assert_within_noise, dist, float64_reference, layout_grads
from _trainer_fixtures import make_items
from test_packed_attention import _batches, _model

from ludic_fast.integrations import packing
from ludic_fast.integrations.transformers import final_hidden_states

PATHS = [("sdpa", "mask"), ("eager", "mask"), ("sdpa", "sdpa_varlen")]
PRECISIONS = ["bf16-weights", "bf16-autocast"]


@functools.cache
def _reference(attn: str) -> dict[str, torch.Tensor]:
    """The float64 padded gradients of `_model("qwen2", attn)` on make_items(8, seed=7): computed once per
    attention and shared by the tests below, which only read them."""
    return layout_grads(float64_reference(_model("qwen2", attn)), make_items(8, seed=7), "cpu", layout="padded",
                        body_kernels=False)


def _packed_and_padded(model, items, precision: str, path: str, **extra) -> dict[str, dict[str, torch.Tensor]]:
    cfg = {"body_kernels": False, "packed_attention": path, **extra}
    if precision == "bf16-autocast":
        cfg["mixed_precision_dtype"] = "bf16"
    weights = torch.bfloat16 if precision == "bf16-weights" else torch.float32
    return {layout: layout_grads(copy.deepcopy(model).to(weights), items, "cpu", layout=layout, **cfg)
            for layout in ("padded", "packed")}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("attn", "path"), PATHS, ids=[f"{a}-{p}" for a, p in PATHS])
def test_packed_equals_padded_in_bf16(attn, path, precision):
    grads = _packed_and_padded(_model("qwen2", attn), make_items(8, seed=7), precision, path)
    assert_within_noise(grads["packed"], grads["padded"], _reference(attn), f"qwen2 {attn} {path} {precision}")


def _merge_first_two(model_inputs):
    """A planted bug: sequences 0 and 1 of every packed micro-batch run as one (1 attends 0)."""

    def leaky(self, batch):
        merged = {k: torch.cat([cu[:1], cu[2:]]) if cu.numel() > 2 else cu
                  for k, cu in batch.items() if k in ("cu_seqlens", "cu_seqlens_host")}  # and its host copy
        return model_inputs(self, {**batch, **merged})

    return leaky


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("path", ["mask", "sdpa_varlen"])
def test_the_criterion_catches_a_sequence_attending_its_neighbour(monkeypatch, path, precision):
    ref = _reference("sdpa")  # before the leak is planted
    monkeypatch.setattr(packing.PackedAttention, "model_inputs",
                        _merge_first_two(packing.PackedAttention.model_inputs))
    grads = _packed_and_padded(_model("qwen2", "sdpa"), make_items(8, seed=7), precision, path,
                               check_packing=False)  # the probe would refuse it
    with pytest.raises(AssertionError, match="packed-vs-fp64"):
        assert_within_noise(grads["packed"], grads["padded"], ref, "planted leak")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flex_attention_forward_in_bf16_equals_padded(arch):
    """Flex attention has no backward on CPU: its packed forward (BlockMask) in bf16 against the padded bf16
    forward under SDPA, hidden states of every real token, with the same criterion against float64 eager."""
    torch._dynamo.reset()  # one shape per compile: a recompile for a second shape hits an Inductor CPU codegen bug
    items = make_items(4, seed=5)
    padded, packed = _batches(items)
    model = _model(arch, "flex_attention").eval().to(torch.bfloat16)
    sdpa = _model(arch, "sdpa").eval().to(torch.bfloat16)
    sdpa.load_state_dict(model.state_dict())
    ref = float64_reference(model).eval()
    resolved = packing.PackedAttention("flex", "flex_attention")  # the trainer refuses flex on CPU (no backward)
    real = padded["attention_mask"].bool()
    pad_inputs = {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}
    with torch.no_grad():
        h = {"packed": final_hidden_states(model, **resolved.model_inputs(packed))[0],
             "padded": final_hidden_states(sdpa, **pad_inputs)[real],
             "ref": final_hidden_states(ref, **pad_inputs)[real]}
    assert dist({"h": h["padded"]}, {"h": h["ref"]}) > 0  # bf16 rounding is there to measure
    assert_within_noise({"h": h["packed"]}, {"h": h["padded"]}, {"h": h["ref"]}, f"{arch} flex forward bf16")
