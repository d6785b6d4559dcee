"""Packed (padding-free) micro-batches equal padded ones per sequence on every attention path this machine runs:
logits, loss and gradients of a Llama and a Qwen2 (GQA, qkv bias, tied head) from eager and sdpa models on the
block-diagonal mask and on per-sequence SDPA (sdpa_varlen, also with a binding sliding window), flex attention's
forward on CPU (BlockMask), and the refusals: flex training on CPU, a model without a transformers attention
implementation, a sliding window shorter than max_seq_len on the mask path, a forced path that does not fit, and
the probe's refusal of inputs that mix sequences (the old position_ids + all-ones mask)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from _trainer_fixtures import TOKENIZER, ListSource, make_items
from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ludic_fast import reference
from ludic_fast.algorithm import make_cispo
from ludic_fast.data.batching import MacroTotals, collate_packed, collate_saw_items, group_index_of
from ludic_fast.data.types import SAWBatch
from ludic_fast.embedded import build_tiny_model
from ludic_fast.integrations.packing import (
    PackedAttention,
    PackedAttentionError,
    attention_implementation,
    auto_attention,
    check_packed_attention,
    document_ids,
    resolve_packed_attention,
    use_sdpa_varlen,
)
from ludic_fast.integrations.sdpa_varlen import SDPA_VARLEN
from ludic_fast.integrations.transformers import final_hidden_states
from ludic_fast.trainer import Trainer, TrainerConfig

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
WINDOW = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}  # Qwen2: every layer, 8 < 16


def _model(arch: str, attn: str, **extra) -> torch.nn.Module:
    if arch == "llama":
        return build_tiny_model(len(TOKENIZER), num_key_value_heads=4, attn_implementation=attn, **SHAPE, **extra)
    cfg = Qwen2Config(vocab_size=len(TOKENIZER), num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=64, attn_implementation=attn, **SHAPE, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg)


def _trainer(model, layout: str, **kw) -> Trainer:
    base = dict(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16, micro_token_budget=128)
    cfg = TrainerConfig(**{**base, "layout": layout, **kw})
    return Trainer(model=model, algo=make_cispo(group_size=1), batch_source=ListSource([make_items(6, seed=3)]),
                   cfg=cfg)


def _batches(items):
    index, macro = group_index_of(items), MacroTotals.of(items)
    return (collate_saw_items(items, pad_token_id=0, group_index=index, macro=macro),
            collate_packed(items, group_index=index, macro=macro))


def test_document_ids():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert document_ids(cu, 8).tolist() == [0, 0, 0, 1, 2, 2, 2, 2]


@pytest.mark.parametrize("lengths,block", [
    ((5, 3, 8), 4), ((3, 0, 5, 9), 4), ((4, 4, 4), 4), ((17,), 4),
    ((300, 1, 127, 129, 256, 40), 128), ((128, 128, 128), 128),
])
def test_block_mask_from_tiles_equals_create_block_mask(lengths, block):
    """The flex BlockMask built from each tile's first / last document equals torch's create_block_mask of the
    rule doc(q) == doc(k) and k <= q, field by field (partial and full tiles, both orientations)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ludic_fast.integrations.packing import _block_mask

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    doc = document_ids(cu, sum(lengths))
    got = _block_mask(doc, block)
    want = create_block_mask(lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q), None, None, doc.numel(),
                             doc.numel(), device="cpu", BLOCK_SIZE=block)
    for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                  "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.seq_lengths == want.seq_lengths
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "arch,path",
    [("llama", "mask"), ("llama", "sdpa_varlen"), ("qwen2", "mask"), ("qwen2", "sdpa_varlen"),
     ("qwen2-window", "sdpa_varlen")],
)
def test_packed_equals_padded_logits_loss_and_gradients(arch, path, attn):
    """Per sequence: logits of the packed row == the padded row's (the model's own eager / sdpa attention); the
    packed micro-batch's CISPO loss and every parameter's gradient == the reference CISPOLoss on the padded
    batch's full logits. qwen2-window: a sliding window of 8 tokens on every layer binds in the longer sequences
    (sdpa_varlen applies it per sequence; the mask path refuses it, tested below, so that pair is not run)."""
    items = make_items(6, seed=3)
    padded, packed = _batches(items)
    model = _model("qwen2", attn, **WINDOW) if arch == "qwen2-window" else _model(arch, attn)
    ref_model = copy.deepcopy(model)
    trainer = _trainer(model, "packed", packed_attention=path)
    assert trainer.packing.path == path
    assert trainer.packing.attn_implementation == (attn if path == "mask" else SDPA_VARLEN)
    if arch == "qwen2-window":
        assert int(packed["cu_seqlens"].diff().max()) > WINDOW["sliding_window"]
    with torch.no_grad():
        h_packed = final_hidden_states(model, **trainer._model_inputs(packed))[0]
        h_padded = final_hidden_states(model, input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
        w = model.get_output_embeddings().weight
        cu = packed["cu_seqlens"].tolist()
        for b in range(len(items)):
            n = cu[b + 1] - cu[b]
            torch.testing.assert_close(h_packed[cu[b]:cu[b + 1]] @ w.T, h_padded[b, :n] @ w.T, rtol=1e-5, atol=1e-5)
    loss, _ = trainer.micro_loss(packed)
    loss.backward()
    logits = ref_model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    ref_loss, _ = reference.CISPOLoss()(padded, logits=logits)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    got = dict(model.named_parameters())
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("path", ["mask", "sdpa_varlen"])
def test_packed_step_gradient_equals_padded_step_gradient(path):
    """Whole-step accumulation (truncate, sort, split into several micro-batches, collate, backward) from one
    init: the same loss and gradients under both layouts."""
    model = _model("llama", "sdpa")
    items = make_items(8, seed=6)
    out = {}
    for layout in ("padded", "packed"):
        trainer = _trainer(copy.deepcopy(model), layout, micro_token_budget=24, packed_attention=path)
        loss, _, sizes, _ = trainer.accumulate_gradients(SAWBatch(items=list(items)))
        assert len(sizes) > 1
        out[layout] = loss, {n: p.grad for n, p in trainer.model.named_parameters()}
    torch.testing.assert_close(out["packed"][0], out["padded"][0], rtol=1e-5, atol=1e-6)
    for name, g in out["padded"][1].items():
        torch.testing.assert_close(out["packed"][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_reference_model_logps_equal_padded():
    items = make_items(5, seed=4)
    padded, packed = _batches(items)
    model = _model("qwen2", "eager")
    cfg = {"kl_target": 1.0}
    t_pad = Trainer(model=copy.deepcopy(model), algo=make_cispo(group_size=1), batch_source=ListSource([items]),
                    cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, **cfg),
                    ref_model=copy.deepcopy(model))
    t_pack = Trainer(model=copy.deepcopy(model), algo=make_cispo(group_size=1), batch_source=ListSource([items]),
                     cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, layout="packed",
                                       **cfg), ref_model=copy.deepcopy(model))
    ref_pad, ref_pack = t_pad.reference_logps(padded), t_pack.reference_logps(packed)
    mask = padded["attention_mask"] > 0
    torch.testing.assert_close(ref_pack[0], ref_pad[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flex_attention_forward_on_cpu_equals_padded(arch):
    """The flex path's BlockMask, checked where it runs here (one forward; the trainer refuses flex on CPU: no
    backward, and a recompile for a second shape hits an Inductor CPU codegen bug): the padded hidden states
    of the same weights under SDPA. (The padded reference is not flex itself: transformers 5.24's padded flex
    path on CPU returns NaN rows for right-padded batches, which the packed BlockMask path does not.)"""
    torch._dynamo.reset()  # one shape per compile (the codegen bug above)
    items = make_items(4, seed=5)
    padded, packed = _batches(items)
    model = _model(arch, "flex_attention").eval()
    reference = _model(arch, "sdpa").eval()
    reference.load_state_dict(model.state_dict())
    packing = PackedAttention("flex", "flex_attention")
    with torch.no_grad():
        h_packed = final_hidden_states(model, **packing.model_inputs(packed))[0]
        h_padded = final_hidden_states(reference, input_ids=padded["input_ids"],
                                       attention_mask=padded["attention_mask"])
    cu = packed["cu_seqlens"].tolist()
    for b in range(len(items)):
        torch.testing.assert_close(h_packed[cu[b]:cu[b + 1]], h_padded[b, :cu[b + 1] - cu[b]], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- refusals
def test_flex_on_cpu_is_refused_for_the_policy_and_a_frozen_model():
    """No flex backward on CPU, and its compiled forward fails at a second sequence length: a frozen model (a
    reference, a teacher) with flex attention would fail at its second batch, so it is refused up front too."""
    with pytest.raises(PackedAttentionError, match="no backward on CPU"):
        _trainer(_model("llama", "flex_attention"), "packed")
    with pytest.raises(PackedAttentionError, match="fails at the second sequence length"):
        resolve_packed_attention(_model("llama", "flex_attention").eval(), device="cpu")


def test_model_without_attention_implementation_is_refused():
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    with pytest.raises(PackedAttentionError, match="no transformers config"):
        resolve_packed_attention(Bare())


def test_sliding_window_shorter_than_max_seq_len_is_refused_on_the_mask_path():
    model = _model("qwen2", "sdpa", **WINDOW)
    with pytest.raises(PackedAttentionError, match="sliding-window"):
        _trainer(model, "packed", packed_attention="mask")  # max_seq_len 16 > window 8
    assert resolve_packed_attention(model, max_seq_len=8).path == "mask"  # the window never binds
    assert _trainer(model, "packed").packing.path == "sdpa_varlen"  # auto: windows applied per sequence


def test_chunked_attention_shorter_than_max_seq_len_is_refused_on_sdpa_varlen():
    model = _model("llama", "sdpa")
    model.config.attention_chunk_size = 8
    with pytest.raises(PackedAttentionError, match="chunked"):
        _trainer(model, "packed")


def test_forced_path_that_does_not_fit_is_refused():
    with pytest.raises(PackedAttentionError, match="does not fit"):
        _trainer(_model("llama", "sdpa"), "packed", packed_attention="varlen")
    with pytest.raises(ValueError, match="packed_attention"):
        TrainerConfig(model_device="cpu", pad_token_id=0, packed_attention="cu_seqlens")
    with pytest.raises(ValueError, match="path must be one of"):
        PackedAttention(path="auto")


class _OldInputs(PackedAttention):
    """What layout='packed' fed the model before: restarting position_ids plus an all-ones attention_mask."""

    def model_inputs(self, batch):
        ids = batch["input_ids"]
        return {"input_ids": ids, "position_ids": batch["position_ids"], "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("path", ["mask", "sdpa_varlen"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_probe_refuses_inputs_that_mix_sequences(attn, path):
    """Restarting position_ids with an all-ones 2D mask let the second sequence attend the first under eager and
    sdpa (and sdpa_varlen without cu_seq_lens: transformers' sdpa): the probe measures it and refuses; the
    resolved path passes it exactly (isolation error 0)."""
    model = _model("llama", attn)
    if path == "sdpa_varlen":
        assert use_sdpa_varlen(model) and attention_implementation(model) == SDPA_VARLEN
    with pytest.raises(PackedAttentionError, match="attend the one before it"):
        check_packed_attention(model, _OldInputs(path="position_ids", attn_implementation=attn))
    packing = resolve_packed_attention(model)
    assert packing.path == path
    errors = check_packed_attention(model, packing)
    assert errors["isolation"] == 0.0 and errors["positions"] < 1e-5


def test_packed_equals_padded_through_a_peft_lora_wrapper():
    """The packed attention inputs pass through PeftModel's forward: same loss and adapter gradients."""
    peft = pytest.importorskip("peft")
    items, model, out = make_items(6, seed=3), _model("llama", "sdpa"), {}
    for layout in ("padded", "packed"):
        torch.manual_seed(0)  # same LoRA init
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                               init_lora_weights=False)
        trainer = Trainer(model=copy.deepcopy(model), algo=make_cispo(group_size=1), lora_config=lora,
                          batch_source=ListSource([items]),
                          cfg=TrainerConfig(model_device="cpu", pad_token_id=0, sync_every_steps=0, max_seq_len=16,
                                            micro_token_budget=32, layout=layout))
        loss, _, _, _ = trainer.accumulate_gradients(SAWBatch(items=list(items)))
        out[layout] = loss, {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(out["packed"][0], out["padded"][0], rtol=1e-5, atol=1e-6)
    assert len(out["padded"][1]) > 0
    for name, g in out["padded"][1].items():
        torch.testing.assert_close(out["packed"][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_auto_attention_moves_eager_and_sdpa_to_flash_flex_or_sdpa_varlen():
    """The choice only (the model stays on the CPU here): on CPU an sdpa or eager model goes to sdpa_varlen; for
    CUDA to flex attention (flash-attention-2 first when flash-attn is installed and the compute is half
    precision), to sdpa_varlen when a sliding window shorter than max_seq_len would bind flex's mask or the head
    dimension is below 16 (flex's CUDA kernel refuses it), and a user's other choice is kept."""
    flash = importlib.util.find_spec("flash_attn") is not None
    for attn in ("sdpa", "eager"):
        model = _model("llama", attn)
        assert auto_attention(model, "cpu", half=True) == SDPA_VARLEN == attention_implementation(model)
    model = _model("llama", "sdpa", head_dim=16)
    assert auto_attention(model, "cuda", half=False) == "flex_attention"
    assert attention_implementation(model) == "flex_attention"
    assert auto_attention(model, "cuda", half=False) is None  # not eager/sdpa any more: kept
    assert not use_sdpa_varlen(model) and attention_implementation(model) == "flex_attention"
    half = _model("qwen2", "eager", head_dim=16)
    assert auto_attention(half, "cuda", half=True) == ("flash_attention_2" if flash else "flex_attention")
    windowed = _model("qwen2", "sdpa", head_dim=16, **WINDOW)
    assert auto_attention(windowed, "cuda", half=False, max_seq_len=8) == "flex_attention"
    windowed = _model("qwen2", "sdpa", head_dim=16, **WINDOW)
    assert auto_attention(windowed, "cuda", half=False, max_seq_len=16) == SDPA_VARLEN
    narrow = _model("qwen2", "sdpa")  # head_dim 32 / 4 = 8
    assert auto_attention(narrow, "cuda", half=False) == SDPA_VARLEN


def test_flex_on_cuda_with_a_head_dimension_below_16_is_refused():
    """Flex attention's CUDA kernel (Triton, tl.dot) refuses head dimensions below 16; resolving names it rather
    than letting the compile fail inside the first forward."""
    with pytest.raises(PackedAttentionError, match="head dimensions \\[8\\]"):
        resolve_packed_attention(_model("llama", "flex_attention"), device="cuda")
    assert resolve_packed_attention(_model("llama", "flex_attention", head_dim=16), device="cuda").path == "flex"


def test_auto_attention_keeps_softcapped_models_on_the_dense_mask():
    """Gemma 2 soft-caps its attention logits (a keyword sdpa_varlen refuses): auto leaves the eager model as it
    is, so the resolved packed path is the exact dense mask, as before sdpa_varlen existed."""
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_implementation="eager")
    model = Gemma2ForCausalLM(config)
    assert auto_attention(model, "cpu", half=False) is None and attention_implementation(model) == "eager"
    assert resolve_packed_attention(model, device="cpu", max_seq_len=64).path == "mask"
