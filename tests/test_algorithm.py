"""RLAlgorithm and presets: Ludic's preset cases (from Ludic's test suite) and end-to-end pipelines
rollouts -> credit -> items -> preprocess -> collation -> loss, checked against ludic_fast.reference."""

from __future__ import annotations

import pytest
import torch

from ludic_fast import losses as L
from ludic_fast import reference
from ludic_fast.algorithm import (
    RLAlgorithm,
    make_cispo,
    make_dapo,
    make_dr_grpo,
    make_grpo,
    make_gspo,
    make_reinforce,
    make_reinforce_baseline,
    make_rl_zvp,
    make_scalerl,
    make_sft,
)
from ludic_fast.data.batching import collate_saw_items, saw_item_from_step
from ludic_fast.data.credit import (
    BatchNormalizedReturn,
    ConstantCredit,
    GroupNormalizedReturn,
    MonteCarloReturn,
    ShapedCredit,
    ZVPGroupNormalizedReturn,
)
from ludic_fast.data.curriculum import NoPositiveResampling
from ludic_fast.data.types import ActorTokenLogps, Rollout, SampleAttachments, SAWBatch, SAWItem, Step, TokenTrace

V, D = 13, 8


def _item(weight, logps=None, meta=None):
    return SAWItem(
        input_ids=[1, 2, 3],
        attention_mask=[1, 1, 1],
        action_mask=[0, 1, 1],
        weight=weight,
        meta=meta or {},
        attachments=SampleAttachments(None if logps is None else ActorTokenLogps(logps)),
    )


# ---------------------------------------------------------------------------- Ludic's preset cases
def test_preset_defaults():
    gspo = make_gspo(group_size=4).loss
    assert isinstance(gspo, L.ClippedSurrogateLoss)
    assert (gspo.clip_eps_low, gspo.clip_eps_high, gspo.length_normalize) == (3e-4, 4e-4, True)
    grpo = make_grpo(group_size=4).loss
    assert isinstance(grpo, L.TokenClippedSurrogateLoss) and (grpo.clip_eps_low, grpo.clip_eps_high) == (0.2, 0.27)
    cispo = make_cispo(group_size=4)
    assert cispo.name == "cispo" and cispo.preprocess is not None
    assert isinstance(cispo.loss, L.CISPOLoss)
    assert (cispo.loss.clip_eps_low, cispo.loss.clip_eps_high, cispo.loss.length_normalize) == (1e6, 0.2, True)
    sft = make_sft()
    assert isinstance(sft.credit_assigner, ConstantCredit) and sft.loss.length_normalize is False
    assert isinstance(make_reinforce().loss, L.ReinforceLoss) and make_reinforce().preprocess is None
    assert make_reinforce_baseline(normalize_adv=True).loss.normalize is True


def test_gspo_loss_needs_old_logp_action():
    batch = collate_saw_items([_item(1.0)], pad_token_id=0)  # no actor logps -> no old_logp_action
    with pytest.raises(KeyError, match="old_logp_action"):
        make_gspo(group_size=1).loss(batch, logits=torch.zeros(1, 3, V))


def test_make_cispo_custom_parameters():
    algo = make_cispo(
        group_size=8, clip_eps_high=0.5, clip_eps_low=0.1, length_normalize=False, positive_only=True, name="mine"
    )
    assert algo.name == "mine"
    assert (algo.loss.clip_eps_low, algo.loss.clip_eps_high, algo.loss.length_normalize) == (0.1, 0.5, False)
    credit = algo.credit_assigner
    assert isinstance(credit, GroupNormalizedReturn)
    assert (credit.group_size, credit.positive_only, credit.normalize_adv) == (8, True, True)


def test_make_cispo_with_kl_is_a_composite():
    loss = make_cispo(group_size=2, kl_coeff=0.05).loss
    assert isinstance(loss, L.CompositeLoss) and [t.name for t in loss.terms] == ["cispo", "kl"]
    assert loss.terms[1].loss.coeff == 0.05


def test_grpo_drops_zero_weight_before_validation():
    batch = SAWBatch([_item(0.0), _item(1.0, [-1.0, -2.0])])
    out = make_grpo(group_size=2, drop_zero_weight=True).preprocess(batch)
    assert [i.weight for i in out.items] == [1.0]
    with pytest.raises(ValueError, match="Missing SampleAttachments.actor_logps"):
        make_grpo(group_size=2).preprocess(SAWBatch([_item(0.0), _item(1.0, [-1.0, -2.0])]))


def test_reinforce_drop_zero_weight():
    out = make_reinforce(drop_zero_weight=True).preprocess(SAWBatch([_item(0.0), _item(2.0)]))
    assert [i.weight for i in out.items] == [2.0]


@pytest.mark.parametrize("preset", [make_grpo, make_dr_grpo, make_dapo, make_gspo, make_cispo, make_scalerl])
def test_group_presets_validate_group_size(preset):
    with pytest.raises(ValueError, match="group_size must be positive"):
        preset(group_size=0)


def test_preset_argument_errors():
    with pytest.raises(ValueError, match="drop_zero_weight_eps"):
        make_grpo(group_size=2, drop_zero_weight=True, drop_zero_weight_eps=-1.0)
    with pytest.raises(ValueError, match="overlong_cache_length"):
        make_dapo(group_size=2, max_completion_length=100)
    with pytest.raises(ValueError, match="norm_length"):
        make_dr_grpo(group_size=2, norm_length=0)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        make_rl_zvp(group_size=1)
    with pytest.raises(ValueError, match="kl_coeff"):
        make_cispo(group_size=2, kl_coeff=-1.0)


# ----------------------------------------------------------------------------- end to end helpers
def _rollouts(spec, seed=0, completion_len=3):
    """spec: list of (group id, prompt id, reward); random prompt/completion ids and behaviour logprobs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid, pid, reward in spec:
        prompt = torch.randint(0, V, (2,), generator=g).tolist()
        completion = torch.randint(0, V, (completion_len,), generator=g).tolist()
        logps = (-torch.rand(completion_len, generator=g) * 3 - 0.1).tolist()
        trace = TokenTrace(prompt, completion, logps, "stop")
        step = Step(0, f"prompt {pid}", "answer", None, reward, trace=trace)
        out.append(Rollout(steps=[step], meta={"request_meta": {"group_id": gid, "prompt_id": pid}, "prompt_id": pid}))
    return out


def _pipeline(algo: RLAlgorithm, rollouts):
    credit = algo.credit_assigner.compute(rollouts)
    items = [saw_item_from_step(r, s, credit[(r.id, s.index)]) for r in rollouts for s in r.steps]
    saw_batch = SAWBatch(items)
    if algo.preprocess is not None:
        saw_batch = algo.preprocess(saw_batch)
    return saw_batch, collate_saw_items(saw_batch.items, pad_token_id=0)


def _head(batch, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*batch["input_ids"].shape, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    return hidden.requires_grad_(), weight.requires_grad_()


def _check_against_reference(algo, ref_loss, batch, seed=1):
    hidden, weight = _head(batch, seed)
    loss, stats = algo.compute_loss(batch, hidden=hidden, weight=weight)
    ref, _ = ref_loss(batch, logits=hidden @ weight.T)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss, [hidden, weight])
    ref_grads = torch.autograd.grad(ref, [hidden, weight])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    return loss, stats


# --------------------------------------------------------------------------------------- pipelines
def test_grpo_pipeline_matches_reference():
    rs = _rollouts([("a", 0, 1.0), ("a", 0, 0.0), ("b", 1, 0.5), ("b", 1, 0.0)])
    algo = make_grpo(group_size=2)
    saw_batch, batch = _pipeline(algo, rs)
    assert batch["weight"].tolist() == pytest.approx([1, -1, 1, -1], abs=1e-6)
    _check_against_reference(algo, reference.TokenClippedSurrogateLoss(0.2, 0.27), batch)


def test_dr_grpo_constant_normaliser():
    rs = _rollouts([("a", 0, 2.0), ("a", 0, 0.0)])
    algo = make_dr_grpo(group_size=2, norm_length=100)
    _, batch = _pipeline(algo, rs)
    assert batch["weight"].tolist() == [1.0, -1.0]  # centred, not std-normalised
    hidden, weight = _head(batch)
    loss, _ = algo.compute_loss(batch, hidden=hidden, weight=weight)
    ref, _ = reference.TokenClippedSurrogateLoss(0.2, 0.27)(batch, logits=hidden @ weight.T)  # Σ per sequence
    torch.testing.assert_close(loss, ref / 100, rtol=1e-5, atol=1e-7)


def test_dapo_overlong_filter_and_soft_punishment():
    algo = make_dapo(group_size=2, max_completion_length=4, overlong_cache_length=2)
    assert isinstance(algo.credit_assigner, ShapedCredit)
    short, long_ = _rollouts([("a", 0, 1.0)], completion_len=2)[0], _rollouts([("a", 0, 1.0)], completion_len=3)[0]
    credit = algo.credit_assigner.compute([short, long_])
    # |y| = 2 is free, |y| = 3 pays (2 - 3) / 2 = -0.5: rewards 1, 0.5 -> normalised ±1
    assert [credit[(short.id, 0)], credit[(long_.id, 0)]] == pytest.approx([1.0, -1.0], abs=1e-6)
    items = [_item(1.0, [-1.0, -1.0], {"truncated": True}), _item(0.5, [-1.0, -1.0], {"finish_reason": "length"}),
             _item(-1.0, [-1.0, -1.0])]
    assert [i.weight for i in algo.preprocess(SAWBatch(items)).items] == [-1.0]
    assert algo.loss.aggregation == "token_mean" and algo.loss.clip_eps_high == 0.28


def test_scalerl_pipeline(tmp_path):
    npr = NoPositiveResampling(tmp_path / "npr.json")
    algo = make_scalerl(group_size=2, no_positive_resampling=npr)
    assert algo.fp32_head and algo.curriculum is npr
    assert isinstance(algo.credit_assigner, BatchNormalizedReturn) and isinstance(algo.loss, L.ScaleRLLoss)
    # prompt 0 mixed, prompt 1 all correct (zero variance, pass rate 1), prompt 2 mixed with other magnitudes
    rs = _rollouts([("a", 0, 1.0), ("a", 0, 0.0), ("b", 1, 1.0), ("b", 1, 1.0), ("c", 2, 0.5), ("c", 2, 0.0)])
    saw_batch, batch = _pipeline(algo, rs)
    assert saw_batch.meta["zvp_filter_frac"] == pytest.approx(1 / 3)
    assert [i.meta["prompt_id"] for i in saw_batch.items] == [0, 0, 2, 2]
    # the history saw every rollout before the filter: prompt 1 is retired, and that was persisted
    assert npr.is_retired(1) and not npr.is_retired(0) and npr.active([0, 1, 2]) == [0, 2]
    assert NoPositiveResampling(tmp_path / "npr.json").is_retired(1)
    # batch std over centred [0.5, -0.5, 0, 0, 0.25, -0.25] = sqrt(0.625 / 6)
    s = (0.625 / 6) ** 0.5
    assert batch["weight"].tolist() == pytest.approx([0.5 / s, -0.5 / s, 0.25 / s, -0.25 / s], rel=1e-5)
    assert batch["group_id"].tolist() == [0, 0, 1, 1]
    _check_against_reference(algo, reference.ScaleRLLoss(eps_max=4.0), batch)


def test_fp32_head_upcasts_inputs():
    rs = _rollouts([("a", 0, 1.0), ("a", 0, 0.0)])
    algo = make_scalerl(group_size=2, no_positive_resampling=False)
    _, batch = _pipeline(algo, rs)
    hidden, weight = _head(batch, dtype=torch.bfloat16)
    loss, _ = algo.compute_loss(batch, hidden=hidden, weight=weight)
    ref, _ = reference.ScaleRLLoss()(batch, logits=hidden.float() @ weight.float().T)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss_logits, _ = algo.compute_loss(batch, logits=(hidden @ weight.T))
    assert loss_logits.dtype == torch.float32
    with pytest.raises(ValueError, match="either logits= or hidden="):
        algo.compute_loss(batch, logits=hidden @ weight.T, hidden=hidden, weight=weight)


def test_scalerl_requires_prompt_ids_for_resampling():
    algo = make_scalerl(group_size=2)
    with pytest.raises(ValueError, match="prompt_id"):
        algo.preprocess(SAWBatch([_item(1.0, [-1.0, -1.0], {"total_reward": 1.0})]))


def test_rl_zvp_pipeline_keeps_zero_variance_groups():
    algo = make_rl_zvp(group_size=2, alpha_zvp=0.1)
    assert isinstance(algo.credit_assigner, ZVPGroupNormalizedReturn) and isinstance(algo.loss, L.ZVPCISPOLoss)
    rs = _rollouts([("p", 0, 1.0), ("p", 0, 1.0), ("n", 1, 0.0), ("n", 1, 0.0), ("m", 2, 1.0), ("m", 2, 0.0)])
    saw_batch, batch = _pipeline(algo, rs)
    assert len(saw_batch.items) == 6
    assert batch["zvp_direction"].tolist() == [1, 1, -1, -1, 0, 0]
    assert batch["weight"].tolist() == pytest.approx([0, 0, 0, 0, 1, -1], abs=1e-6)
    loss, _ = _check_against_reference(algo, reference.ZVPCISPOLoss(alpha_zvp=0.1), batch)
    # the zero-variance sequences carry gradient: ZVP differs from plain CISPO on the same batch
    hidden, weight = _head(batch)
    cispo, _ = reference.CISPOLoss()(batch, logits=hidden @ weight.T)
    assert not torch.allclose(loss, cispo)


def test_reinforce_pipeline_matches_reference():
    rs = _rollouts([("a", 0, 1.0), ("a", 0, -0.5)])
    algo = make_reinforce()
    assert isinstance(algo.credit_assigner, MonteCarloReturn)
    _, batch = _pipeline(algo, rs)
    _check_against_reference(algo, reference.ReinforceLoss(), batch)
