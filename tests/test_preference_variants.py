"""The DPO loss types of TRL 1.16 (alone, combined, f-DPO, LD-DPO, WPO), CPO / AlphaPO and SimPO's NLL term
against their plain-PyTorch twins (`ludic_fast.reference.preference`: fp32 1e-5; float64 1e-12), hand-derived
values, the policy statistics (entropy, KL per side), validation and `make_preference_loss`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_losses_common import rel_err, to_packed
from test_preference import CHUNKS, make_pairs

from ludic_fast import reference as R
from ludic_fast.losses import preference as P
from ludic_fast.losses.preference.dpo_terms import LOSS_TYPES
from ludic_fast.reference import preference as RP

_SMOOTHED = {"exo_pair": 0.01, "robust": 0.1, "aot": 0.05}
DPO_CASES = [(t, dict(loss_type=t, beta=0.7, label_smoothing=_SMOOTHED.get(t, 0.0))) for t in LOSS_TYPES]
DPO_CASES += [
    ("rpo", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3])),
    ("mpo", dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0])),
    ("fkl_sigmoid", dict(f_divergence="forward_kl", beta=0.5)),
    ("js_hinge", dict(loss_type="hinge", f_divergence="js_divergence", beta=0.5)),
    ("js_ipo", dict(loss_type="ipo", f_divergence="js_divergence", beta=0.5)),  # log 2 counts here (n_w != n_l)
    ("js_sigmoid_norm", dict(loss_type="sigmoid_norm", f_divergence="js_divergence", beta=0.5)),
    ("alpha_ipo", dict(loss_type="ipo", f_divergence="alpha_divergence", f_alpha=0.3)),
    ("alpha_discopop", dict(loss_type="discopop", f_divergence="alpha_divergence", discopop_tau=0.5, beta=0.4)),
    ("ld_sigmoid", dict(ld_alpha=0.4, beta=0.5)),
    ("ld_aot", dict(loss_type="aot", ld_alpha=0.0)),
    ("wpo_sigmoid", dict(use_weighting=True, beta=0.5)),
    ("wpo_rpo", dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], use_weighting=True, ld_alpha=0.5)),
    ("dpo_entropy", dict(entropy_stats=True, label_smoothing=0.1)),
]
CPO_CASES = [
    ("cpo", P.CPOLoss, RP.CPOLoss, dict()),
    ("cpo_ls", P.CPOLoss, RP.CPOLoss, dict(beta=0.4, label_smoothing=0.2, cpo_alpha=0.5)),
    ("cpo_hinge", P.CPOLoss, RP.CPOLoss, dict(loss_type="hinge", beta=0.3)),
    ("cpo_ipo", P.CPOLoss, RP.CPOLoss, dict(loss_type="ipo", cpo_alpha=0.0)),
    ("cpo_simpo", P.CPOLoss, RP.CPOLoss, dict(loss_type="simpo", simpo_gamma=0.3, beta=2.0)),
    ("alphapo", P.CPOLoss, RP.CPOLoss, dict(loss_type="simpo", alpha=0.25, cpo_alpha=0.0, beta=2.0)),
    ("alpha_sigmoid", P.CPOLoss, RP.CPOLoss, dict(alpha=-0.05, entropy_stats=True)),
    ("simpo_nll", P.SimPOLoss, RP.SimPOLoss, dict(nll_coeff=0.7, entropy_stats=True)),
    ("orpo_entropy", P.ORPOLoss, RP.ORPOLoss, dict(entropy_stats=True)),
    ("ipo_entropy", P.IPOLoss, RP.IPOLoss, dict(entropy_stats=True)),
]
CASES = [(n, P.DPOLoss, RP.DPOLoss, kw) for n, kw in DPO_CASES] + CPO_CASES


def _compare(ours, ref, batch, h, W, b, tol, grad_tol, **call):
    ref_loss, ref_stats = ref(batch, logits=R.head_logits(h, W, b))
    ref_grads = torch.autograd.grad(ref_loss, (h, W, b))
    loss, stats = ours(batch, hidden=h, weight=W, bias=b, **call)
    grads = torch.autograd.grad(loss, (h, W, b))
    assert loss.dtype == ref_loss.dtype and rel_err(loss, ref_loss) <= tol, (float(loss.detach()), float(ref_loss))
    assert set(stats) == set(ref_stats), set(stats) ^ set(ref_stats)
    for k, v in ref_stats.items():
        assert stats[k].dtype == v.dtype, k
        assert abs(float(stats[k]) - float(v)) <= tol * max(1.0, abs(float(v))), (k, float(stats[k]), float(v))
    for name, g, rg in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert rel_err(g, rg) <= grad_tol, (name, rel_err(g, rg))


@pytest.mark.parametrize("chunk", ["one_pass", "two_pass"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_twin_fp32(case, chunk):
    _, ours, ref, kw = case
    batch, h, W, b = make_pairs(1)
    _compare(ours(**kw), ref(**kw), batch, h, W, b, 1e-5, 1e-5, chunk_elements=CHUNKS[chunk])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_twin_float64(case):
    # float64 head inputs and reference log-probs: every value float64, 1e-12 from the twin
    _, ours, ref, kw = case
    batch, h, W, b = make_pairs(2, dtype=torch.float64)
    batch["ref_logps"] = batch["ref_logps"].double()
    _compare(ours(**kw), ref(**kw), batch, h, W, b, 1e-12, 1e-12, chunk_elements=CHUNKS["one_pass"])


@pytest.mark.parametrize("path", ["generic", "logits", "packed"])
def test_other_paths(path):
    kw = dict(loss_type=["sigmoid", "sft", "apo_zero"], loss_weights=[1.0, 0.2, 0.5], use_weighting=True,
              entropy_stats=True)
    batch, h, W, b = make_pairs(3)
    ref_loss, ref_stats = RP.DPOLoss(**kw)(batch, logits=R.head_logits(h, W, b))
    ours = P.DPOLoss(**kw)
    if path == "generic":
        loss, stats = ours(batch, hidden=h, weight=W, bias=b, fused=False)
    elif path == "logits":
        loss, stats = ours(batch, logits=R.head_logits(h, W, b))
    else:
        packed, hh = to_packed(batch, h)
        loss, stats = ours(packed, hidden=hh, weight=W, bias=b, chunk_elements=CHUNKS["one_pass"])
    assert rel_err(loss, ref_loss) <= 1e-5
    for k, v in ref_stats.items():
        assert abs(float(stats[k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), k
    g, rg = torch.autograd.grad(loss, h)[0], torch.autograd.grad(ref_loss, h)[0]
    assert rel_err(g, rg) <= 1e-5


def test_wpo_key_given_and_head_transform():
    # batch['log_sum_sq_probs'] given is used as is; computed, it follows the head transform (softcap, scale)
    batch, h, W, b = make_pairs(4)
    z = 3.0 * torch.tanh(0.5 * R.head_logits(h, W, b) / 3.0)
    loss, _ = P.DPOLoss(use_weighting=True)(batch, hidden=h, weight=W, bias=b, logit_scale=0.5, softcap=3.0)
    ref_loss, _ = RP.DPOLoss(use_weighting=True)(batch, logits=z)
    assert rel_err(loss, ref_loss) <= 1e-5
    given = dict(batch, log_sum_sq_probs=torch.full(batch["input_ids"].shape, -1.5))
    loss, stats = P.DPOLoss(use_weighting=True)(given, hidden=h, weight=W, bias=b)
    ref_loss, ref_stats = RP.DPOLoss(use_weighting=True)(given, logits=R.head_logits(h, W, b))
    assert rel_err(loss, ref_loss) <= 1e-5 and abs(float(stats["wpo_weight"] - ref_stats["wpo_weight"])) < 1e-6


# ------------------------------------------------------------------------------------ hand-derived values
def _one_token_pairs(ref_offsets, n_vocab=3):
    """Pairs of one-token responses under a uniform policy (every log-prob -log V); R = L - offset."""
    S = len(ref_offsets)
    lw = -math.log(n_vocab)
    batch = {"input_ids": torch.tensor([[0, 1]] * S), "action_mask": torch.tensor([[0.0, 1.0]] * S),
             "ref_seq_logps": torch.tensor([lw - o for o in ref_offsets])}
    return batch, torch.zeros(S, 2, 2, requires_grad=True), torch.zeros(n_vocab, 2, requires_grad=True)


@pytest.mark.parametrize("loss_type,beta,eps,expected", [
    # c_w = 1, c_l = -1 (one pair), β = 0.5: x = β Δ = 1
    ("sigmoid", 0.5, 0.0, math.log1p(math.exp(-1.0))),
    ("hinge", 0.5, 0.0, 0.0),  # relu(1 - 1)
    ("hinge", 0.25, 0.0, 0.5),  # relu(1 - 0.5)
    ("ipo", 0.5, 0.0, 1.0),  # (2 - 1/(2·0.5))²
    ("sppo_hard", 0.5, 0.0, 0.0),  # (1 - 1)² + (-1 + 1)²
    ("bco_pair", 0.5, 0.0, 2 * math.log1p(math.exp(-0.5))),
    ("apo_zero", 0.5, 0.0, 2.0 - 2.0 / (1.0 + math.exp(-0.5))),  # 1 - σ(0.5) + σ(-0.5)
    ("robust", 0.5, 0.1, (0.9 * math.log1p(math.exp(-1.0)) - 0.1 * math.log1p(math.exp(1.0))) / 0.8),
])
def test_hand_derived_loss_types(loss_type, beta, eps, expected):
    batch, h, W = _one_token_pairs([1.0, -1.0])
    loss, stats = P.DPOLoss(loss_type=loss_type, beta=beta, label_smoothing=eps)(batch, hidden=h, weight=W)
    assert abs(loss.item() - expected) < 1e-6, (loss.item(), expected)
    assert abs(float(stats["kl_chosen"]) - 1.0) < 1e-6 and abs(float(stats["kl_rejected"]) + 1.0) < 1e-6


def test_hand_derived_cpo_and_combination():
    # uniform policy over 3 tokens, one-token responses: L_w = L_l = -log 3, so Δ = 0 for every CPO type;
    # sigmoid: log 2 + cpo_alpha · log 3 (NLL of the chosen token); hinge: 1; ipo: (1/(2β))²
    batch, h, W = _one_token_pairs([0.0, 0.0])
    for kw, want in ((dict(), math.log(2) + math.log(3)), (dict(loss_type="hinge", cpo_alpha=0.0), 1.0),
                     (dict(loss_type="ipo", beta=0.25, cpo_alpha=0.5), 4.0 + 0.5 * math.log(3))):
        loss, stats = P.CPOLoss(**kw)(batch, hidden=h, weight=W)
        assert abs(loss.item() - want) < 1e-6, (kw, loss.item(), want)
        assert abs(float(stats["nll"]) - math.log(3)) < 1e-6
    # RPO = sigmoid + α sft with c_w = c_l = 0: log 2 + α log 3
    loss, _ = P.make_preference_loss(["sigmoid", "sft"], weights=[1.0, 0.5])(batch, hidden=h, weight=W)
    assert abs(loss.item() - (math.log(2) + 0.5 * math.log(3))) < 1e-6


def test_hand_derived_entropy_and_wpo_weight():
    # uniform policy over V = 3: entropy log 3; log Σ p² = log(1/3), lp - log Σp² = 0, so the WPO weight is 1
    batch, h, W = _one_token_pairs([1.0, -1.0])
    loss, stats = P.DPOLoss(use_weighting=True, entropy_stats=True, beta=0.5)(batch, hidden=h, weight=W)
    assert abs(float(stats["entropy_chosen"]) - math.log(3)) < 1e-6
    assert abs(float(stats["wpo_weight"]) - 1.0) < 1e-6
    assert abs(loss.item() - math.log1p(math.exp(-1.0))) < 1e-6


def test_ld_alpha_weights_the_longer_tail():
    # chosen of 3 tokens, rejected of 1: with ld_alpha a the chosen's last two tokens weigh a in L and R
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(2, 4, 5, generator=g), torch.randn(7, 5, generator=g)
    ids = torch.randint(0, 7, (2, 4), generator=g)
    amask = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 0, 0]])
    ref = torch.randn(2, 4, generator=g) * amask
    batch = {"input_ids": ids, "action_mask": amask, "ref_logps": ref}
    lp = torch.log_softmax(h @ W.T, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    for a in (0.0, 0.3, 1.0):
        w = torch.tensor([[1.0, a, a], [1.0, 0, 0]])
        c = ((lp - ref[:, 1:]) * w).sum(1)
        expected = F.softplus(-0.1 * (c[0] - c[1]))
        loss, _ = P.DPOLoss(ld_alpha=a)(batch, hidden=h, weight=W)
        assert abs(loss.item() - float(expected)) < 1e-6, a


# ------------------------------------------------------------------------------------- factory, validation
def test_make_preference_loss():
    assert P.make_preference_loss("hinge", beta=0.3) == P.DPOLoss(loss_type="hinge", beta=0.3)
    rpo = P.make_preference_loss(["sigmoid", "sft"], weights=[1.0, 0.1])
    assert rpo == P.DPOLoss(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.1])
    assert P.make_preference_loss("cpo_simpo", simpo_gamma=0.2) == P.CPOLoss(loss_type="simpo", simpo_gamma=0.2)
    assert P.make_preference_loss("alphapo", alpha=0.1) == P.CPOLoss(loss_type="simpo", cpo_alpha=0.0, alpha=0.1)
    assert P.make_preference_loss("simpo", nll_coeff=1.0) == P.SimPOLoss(nll_coeff=1.0)
    assert isinstance(P.make_preference_loss("kto"), P.KTOLoss)
    with pytest.raises(ValueError, match="loss_type"):
        P.make_preference_loss("dpo_typo")
    with pytest.raises(ValueError, match="combine"):
        P.make_preference_loss(["sigmoid", "orpo"])
    with pytest.raises(ValueError, match="weights"):
        P.make_preference_loss(["sigmoid", "sft"], weights=[1.0])
    with pytest.raises(ValueError, match="weights"):
        P.make_preference_loss("orpo", weights=[1.0])
    with pytest.raises(ValueError, match="alpha"):
        P.make_preference_loss("alphapo")
    with pytest.raises(ValueError, match="cpo_alpha"):
        P.make_preference_loss("alphapo", alpha=0.1, cpo_alpha=1.0)
    with pytest.raises(TypeError, match="no option 'gamma'"):
        P.make_preference_loss("sigmoid", gamma=1.0)


@pytest.mark.parametrize("kw,match", [
    (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing"),
    (dict(loss_type="exo_pair"), "exo_pair"),
    (dict(loss_type="bco_pair", f_divergence="forward_kl"), "f_divergence"),
    (dict(f_divergence="chi2"), "f_divergence"),
    (dict(f_alpha=0.3), "f_alpha"),
    (dict(discopop_tau=0.1), "discopop_tau"),
    (dict(ld_alpha=1.5), "ld_alpha"),
    (dict(loss_type="ipo", length_normalize=True), "length_normalize"),
    (dict(loss_type="aot", use_weighting=True), "use_weighting"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "loss_weights"),
    (dict(loss_type="nope"), "loss_type"),
])
def test_dpo_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        P.DPOLoss(**kw)


def test_cpo_validation_and_ld_needs_token_ref():
    for kw, match in ((dict(loss_type="kto"), "loss_type"), (dict(loss_type="hinge", label_smoothing=0.1),
                      "label_smoothing"), (dict(simpo_gamma=0.5), "simpo_gamma"), (dict(cpo_alpha=-1.0), "cpo_alpha")):
        with pytest.raises(ValueError, match=match):
            P.CPOLoss(**kw)
    batch, h, W = _one_token_pairs([0.0, 0.0])
    with pytest.raises(KeyError, match="ref_logps"):
        P.DPOLoss(ld_alpha=0.5)(batch, hidden=h, weight=W)


def test_batch_sorted_types_couple_the_batch():
    batch, h, W, b = make_pairs()
    from ludic_fast.token_batch import TokenBatch

    tb = TokenBatch.from_batch(batch)
    assert P.DPOLoss(loss_type="aot").coupling_groups(tb) is None
    assert P.DPOLoss(loss_type="hinge").coupling_groups(tb) is not None


@pytest.mark.parametrize("kto_kl", [None, 0.3])
def test_kto_float64(kto_kl):
    # float64 KTO: the in-batch KL estimate z0 (or a float64 batch['kto_kl']) and the loss stay float64, 1e-12
    batch, h, W, b = make_pairs(5, dtype=torch.float64, kto=True)
    batch["ref_logps"] = batch["ref_logps"].double()
    if kto_kl is not None:
        batch["kto_kl"] = torch.tensor(kto_kl, dtype=torch.float64) + 1e-9  # not a float32 number
    _compare(P.KTOLoss(beta=0.5), RP.KTOLoss(beta=0.5), batch, h, W, b, 1e-12, 1e-12,
             chunk_elements=CHUNKS["one_pass"])


LIGER_TYPES = ["hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop"]


@pytest.mark.parametrize("loss_type", LIGER_TYPES)
def test_dpo_loss_types_match_liger(loss_type):
    # Liger-Kernel 0.8.5's LigerFusedLinearDPOLoss with the same loss_type, its reference model's head and our
    # per-token reference log-probs from that same head
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    from test_preference import _liger_inputs

    batch, h, W, b = make_pairs(6)
    ref_W = W.detach() + 0.2 * torch.randn(W.shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref_lp = torch.zeros_like(batch["ref_logps"])
        ref_lp[:, 1:] = R.compute_token_logp(R.head_logits(h, ref_W, b), batch["input_ids"])
    batch["ref_logps"] = ref_lp * batch["action_mask"]
    eps = _SMOOTHED.get(loss_type, 0.0)
    loss, _ = P.DPOLoss(loss_type=loss_type, beta=0.5, label_smoothing=eps)(
        batch, hidden=h, weight=W, bias=b, chunk_elements=CHUNKS["one_pass"])
    grads = torch.autograd.grad(loss, (h, W, b))
    x, target = _liger_inputs(batch, h)
    liger = chunked.LigerFusedLinearDPOLoss(beta=0.5, loss_type=loss_type, label_smoothing=eps, compiled=False)
    peer = liger(W, x, target, b, ref_input=x.detach(), ref_weight=ref_W, ref_bias=b.detach())[0]
    peer_grads = torch.autograd.grad(peer, (h, W, b))
    assert rel_err(loss, peer) <= 1e-5, (float(loss.detach()), float(peer.detach()))
    for g, pg in zip(grads, peer_grads):
        assert rel_err(g, pg) <= 1e-4


def test_what_a_trainer_must_provide():
    # the reference model's log-probs: DPO / IPO / KTO read them, the reference-free losses do not; LD-DPO
    # needs them per token
    needs = {type(f).__name__: f.uses_reference for f in (P.DPOLoss(), P.IPOLoss(), P.KTOLoss(), P.CPOLoss(),
                                                            P.SimPOLoss(), P.ORPOLoss())}
    assert needs == {"DPOLoss": True, "IPOLoss": True, "KTOLoss": True, "CPOLoss": False, "SimPOLoss": False,
                     "ORPOLoss": False}
    assert P.DPOLoss(ld_alpha=0.5).needs_token_reference and not P.DPOLoss().needs_token_reference
    assert not P.CPOLoss().needs_token_reference and not P.KTOLoss().needs_token_reference


def test_wpo_bf16_head_loose():
    # bf16 hidden and weight: the pre-pass multiplies in bf16 (as the head on the CPU), the twin upcasts the same
    # bf16 values; the RL losses' documented bf16 tolerance
    batch, h, W, b = make_pairs(2)
    hb, Wb = h.detach().bfloat16().requires_grad_(True), W.detach().bfloat16()
    loss, stats = P.DPOLoss(use_weighting=True)(batch, hidden=hb, weight=Wb, bias=b.detach())
    ref_loss, ref_stats = RP.DPOLoss(use_weighting=True)(batch, logits=R.head_logits(hb.float(), Wb.float(), b))
    assert rel_err(loss, ref_loss) <= 3e-2 and rel_err(stats["wpo_weight"], ref_stats["wpo_weight"]) <= 3e-2
