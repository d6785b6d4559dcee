"""ludic_fast.integrations.verl: the fused PPO forward against the model's own logits, the policy losses against
hand-written formulas, and (when verl is importable) against verl's functions of the same name."""

from __future__ import annotations

import importlib.util
import os
import runpy
from pathlib import Path

import pytest
import torch

from ludic_fast.integrations import verl as lv

transformers = pytest.importorskip("transformers", reason="transformers not installed")

B, T = 5, 8


def _model():
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)
    return model


def _ids():
    return torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def test_fused_forward_equals_rolled_log_softmax_of_the_logits():
    model, ids = _model(), _ids()
    temperature = 0.7
    out = lv.fused_ppo_forward(model, ids, torch.ones_like(ids), temperature=temperature)
    logp = torch.log_softmax(model(input_ids=ids).logits.float() / temperature, -1)
    rolled = torch.roll(ids, -1, -1)
    torch.testing.assert_close(out.log_probs, logp.gather(-1, rolled[..., None]).squeeze(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)


def test_patched_forward_returns_log_probs_and_entropy_with_gradients():
    model, ids = _model(), _ids()
    labels = ids.clone()
    labels[:, :3] = -100  # prompt positions
    lv.patch_fused_forward(model)
    try:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), temperature=1.0, labels=labels,
                    return_dict=True, use_cache=False)
    finally:
        lv.unpatch_fused_forward(model)
    assert isinstance(out, lv.FusedPPOOutput) and out["log_probs"] is out.log_probs
    # rolled labels: positions 0-1 score prompt labels (-100), the last one wraps around to labels[:, 0] = -100
    assert torch.all(out.log_probs[:, :2] == 0) and torch.all(out.log_probs[:, -1] == 0)
    assert torch.all(out.log_probs[:, 2:-1] < 0)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0
    assert hasattr(model(input_ids=ids), "logits")  # unpatched again


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) - 2
    lp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_()
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[1] = 0
    return old, lp, adv, mask


CFG = {"clip_ratio": 0.2, "clip_ratio_low": 0.15, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0,
       "tau_neg": 1.05}


def test_cispo_token_mean_matches_the_formula():
    old, lp, adv, mask = _inputs()
    loss, metrics = lv.policy_loss_cispo(old, lp, adv, mask, "token-mean", CFG)
    r = torch.exp(lp.detach() - old)
    expected = (-(r.clamp(0.85, 1.28)) * adv * lp * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float((((r < 0.85) | (r > 1.28)).float() * mask).sum()
                                                               / mask.sum()), rel=1e-5)


def test_vanilla_dual_clip_caps_negative_advantages():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[2.0, 0.0]], requires_grad=True)  # r = e^2 (far above the clip) and 1
    adv = torch.tensor([[-1.0, 2.0]])
    loss, _ = lv.policy_loss_vanilla(old, lp, adv, torch.ones(1, 2), "token-sum", CFG)
    # token 0: max(e^2, 1.28) = e^2 capped at -A * c = 3; token 1: -2 * 1
    torch.testing.assert_close(loss, torch.tensor(3.0 - 2.0))


def test_gspo_uses_the_sequence_ratio():
    old, lp, adv, mask = _inputs(2)
    adv = adv[:, :1].expand(B, T)
    loss, _ = lv.policy_loss_gspo(old, lp, adv, mask, "seq-mean-token-mean", CFG)
    seq = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))
    per_seq = torch.maximum(-adv[:, 0] * seq, -adv[:, 0] * seq.clamp(0.85, 1.28))
    has = mask.sum(-1) > 0
    torch.testing.assert_close(loss, per_seq[has].sum() / has.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", lv.AGG_MODES)
def test_aggregation_modes(mode):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    x[2, 0] = float("nan")  # masked NaNs do not leak
    expected = {"token-mean": 7.0 / 3, "token-sum": 7.0, "seq-mean-token-sum": 3.5,
                "seq-mean-token-sum-norm": 3.5 / 3, "seq-mean-token-mean": (1.5 + 4.0) / 2}[mode]
    assert float(lv.aggregate(x, m, mode)) == pytest.approx(expected, rel=1e-6)
    assert float(lv.aggregate(x, m, mode, dp_size=2, batch_num_tokens=6, global_batch_size=4)) == pytest.approx(
        {"token-mean": 14.0 / 6, "token-sum": 14.0, "seq-mean-token-sum": 3.5,
         "seq-mean-token-sum-norm": 3.5 / 3, "seq-mean-token-mean": 5.5 / 2}[mode], rel=1e-6)


def test_bad_aggregation_mode_is_rejected():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        lv.aggregate(torch.ones(1, 1), torch.ones(1, 1), "mean")


HAS_VERL = importlib.util.find_spec("verl") is not None
# `make test` runs this file a second time in .venv-verl (verl installed as verl pins it) with this set: there a
# missing verl is a failure, not a skip.
REQUIRE_VERL = os.environ.get("LUDIC_FAST_REQUIRE_VERL") == "1"
needs_verl = pytest.mark.skipif(not HAS_VERL and not REQUIRE_VERL, reason="verl not installed (see `make test`)")


@needs_verl
def test_importing_the_integration_registers_the_losses_with_verl():
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    assert {lv.PREFIX + name for name in lv.POLICY_LOSSES} <= set(POLICY_LOSS_REGISTRY)


BATCH_INFO = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 9, "loss_scale_factor": 6}


@needs_verl
@pytest.mark.parametrize("batch_info", [{}, BATCH_INFO], ids=["local", "dp2"])
@pytest.mark.parametrize("is_weights", [False, True], ids=["no_is", "is"])
@pytest.mark.parametrize("name", sorted(lv.POLICY_LOSSES))
@pytest.mark.parametrize("mode", lv.AGG_MODES)
def test_registered_losses_equal_verls_own(name, mode, is_weights, batch_info):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(rollout_n=1, ppo_micro_batch_size_per_gpu=1, **CFG)
    config.global_batch_info.update(batch_info)  # as verl's actor does (workers/utils/losses.py)
    old, lp, adv, mask = _inputs(3)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(4)) + 0.5 if is_weights else None
    results = []
    for fn in (get_policy_loss_fn(name), get_policy_loss_fn(lv.PREFIX + name)):
        x = lp.detach().clone().requires_grad_()
        loss, metrics = fn(old, x, adv, mask, mode, config, weights)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    (l1, g1, m1), (l2, g2, m2) = results
    torch.testing.assert_close(l2, l1)
    torch.testing.assert_close(g2, g1)
    assert m2.keys() == m1.keys() and m2 == pytest.approx(m1)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


@needs_verl
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("layout", ["padded", "rmpad_shift_labels"])
def test_patched_forward_equals_verls_fused_torch_forward(temperature, layout):
    """Same model, same call as verl's engine makes (padded, or remove-padding: one packed row with
    restarting position_ids and the globally rolled `shift_labels`): log_probs, entropy and the gradients of
    (sum lp + 0.3 sum H) equal those of verl's own `use_fused_kernels` forward (torch backend)."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    ids = torch.randint(0, 211, (3, 9), generator=torch.Generator().manual_seed(5))
    call = {"temperature": temperature, "return_dict": True, "use_cache": False}
    if layout == "padded":
        call.update(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(9).expand(3, 9))
    else:
        packed = ids.reshape(1, -1)
        shift_labels = torch.roll(packed, -1, -1)
        shift_labels[0, 8::9] = torch.tensor([1, 2, 3])  # differ from a roll of input_ids: used verbatim
        call.update(input_ids=packed, position_ids=torch.arange(9).repeat(3)[None], shift_labels=shift_labels)

    def run(model):
        model.zero_grad(set_to_none=True)
        out = model(**call)
        (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), {n: p.grad for n, p in model.named_parameters()}

    ours = lv.patch_fused_forward(_llama())
    try:
        lp1, h1, g1 = run(ours)
    finally:
        lv.unpatch_fused_forward(ours)
    theirs = _llama()
    cls_forward = type(theirs).forward
    patch_forward_with_backends(theirs, use_fused_kernels=True, fused_kernels_backend="torch")
    try:
        lp2, h2, g2 = run(theirs)
    finally:
        type(theirs).forward = cls_forward
    torch.testing.assert_close(lp1, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1, h2, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_the_verl_example_runs_and_takes_the_loss_from_verls_registry_when_present(capsys):
    example = Path(__file__).resolve().parents[1] / "examples" / "verl_fused_forward.py"
    runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    assert "|grad lm_head|" in out
    assert ("verl get_policy_loss_fn('ludic_fast_cispo')" in out) == HAS_VERL
