"""Ludic's numbers (its loss tests and hand-derived checks) through our classes, and hand-checked RL-ZVP and
ScaleRL cases. Each case runs the logits path and both hidden paths (hidden = logits, weight = identity)."""

from __future__ import annotations

import math

import pytest
import torch

from ludic_fast import losses as L
from ludic_fast.token_batch import TokenBatch

LN2 = math.log(2.0)


def run_paths(loss_fn, batch, logits):
    """[(loss, stats) for the logits, fused-hidden and generic-hidden paths]; all must agree."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    V = logits.shape[-1]
    eye = torch.eye(V)
    out = [loss_fn(batch, logits=logits)]
    for fused in (True, False):
        out.append(loss_fn(batch, hidden=logits, weight=eye, fused=fused, chunk_elements=V))
    return out


def check(loss_fn, batch, logits, expected, atol=1e-5, **stats):
    for loss, got in run_paths(loss_fn, batch, logits):
        assert float(loss) == pytest.approx(expected, abs=atol)
        for k, v in stats.items():
            assert float(got[k]) == pytest.approx(v, abs=atol), k


def ids(*rows):
    return torch.tensor(rows)


def mask(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# -------------------------------------------------------------------------------------- Ludic's tests
def test_logp_action_via_kl():
    logits = [[[1, 1, 3, 1], [4, 2, 1, 1], [1, 5, 1, 1]]]
    batch = {"input_ids": ids([2, 0, 1]), "action_mask": mask([0, 1, 1]), "old_logp_action": torch.zeros(1)}
    check(L.KLLoss(), batch, logits, -4.55175, atol=1e-3)
    logits = [[[0, 0], [1, 0], [0, 2], [3, 0]]]
    batch = {"input_ids": ids([0, 1, 0, 1]), "action_mask": mask([0, 0, 1, 1]), "old_logp_action": torch.zeros(1)}
    check(L.KLLoss(), batch, logits, -0.440190)
    check(L.KLLoss(length_normalize=True), batch, logits, -0.220095)


def test_reinforce_on_and_off_policy():
    L_on = -1.313262  # lsm([1, 2])[1]: position 0 scores token 1
    batch = {"input_ids": ids([1, 0]), "action_mask": mask([0, 1]), "weight": torch.tensor([2.0]),
             "old_logp_action": torch.tensor([L_on])}
    check(L.ReinforceLoss(), batch, [[[1, 2], [3, 1]]], 2.626523, adv_mean=2.0, logp_mean=-1.313262,
          ratio_mean=1.0, kl_actor_policy=0.0)
    batch = {"input_ids": ids([0, 1]), "action_mask": mask([0, 1]), "weight": torch.tensor([1.0]),
             "old_logp_action": torch.tensor([-2 * LN2])}
    check(L.ReinforceLoss(), batch, [[[0, 0], [0, 0]]], 1.386294, ratio_mean=2.0)
    with pytest.raises(KeyError, match="old_logp_action"):
        L.ReinforceLoss()({k: v for k, v in batch.items() if k != "old_logp_action"}, logits=torch.zeros(1, 2, 2))


@pytest.mark.parametrize("normalize,expected", [(False, 0.25), (True, 0.5)])
def test_reinforce_baseline(normalize, expected):
    logits = [[[1, 2], [3, 1]], [[2, 1], [1, 2]]]
    batch = {"input_ids": ids([1, 0], [0, 0]), "action_mask": mask([0, 1], [0, 1]),
             "weight": torch.tensor([1.5, 0.5]), "old_logp_action": torch.tensor([-1.313262, -0.313262])}
    check(L.ReinforceBaselineLoss(normalize=normalize), batch, logits, expected, baseline=1.0, adv_mean=0.0)


def test_gspo_cases():
    batch = {"input_ids": ids([0, 1, 0]), "action_mask": mask([0, 1, 1]), "weight": torch.tensor([1.0]),
             "old_logp_action": torch.zeros(1)}
    logits = [[[0, 0], [2, 0], [0, 0]]]
    check(L.ClippedSurrogateLoss(1.0, 1.0), batch, logits, -0.440399)
    check(L.ClippedSurrogateLoss(1.0, 1.0, length_normalize=True), batch, logits, -0.663625)
    zeros = [[[0, 0], [0, 0]]]
    base = {"input_ids": ids([0, 1]), "action_mask": mask([0, 1])}
    cases = [  # (R, eps, A, ratio_clip, expected)
        (2.0, 0.1, 1.0, None, -1.1),
        (0.5, 0.2, -1.0, None, 0.8),
        (10.0, 10.0, 1.0, 2.0, -2.0),
    ]
    for R, eps, A, rc, expected in cases:
        batch = {**base, "weight": torch.tensor([A]), "old_logp_action": torch.tensor([-LN2 - math.log(R)])}
        check(L.ClippedSurrogateLoss(eps, eps, ratio_clip=rc), batch, zeros, expected)


def _zero_logit_batch(r: float, A: float, n_tokens: int = 1):
    """V=2 zero logits (every lp = ln 0.5); the first action token has ratio r, the rest ratio 1."""
    T = n_tokens + 1
    actor = torch.zeros(1, T)
    actor[0, 1:] = -LN2
    actor[0, 1] = -LN2 - math.log(r)
    batch = {"input_ids": torch.zeros(1, T, dtype=torch.long), "action_mask": mask([0] + [1] * n_tokens),
             "weight": torch.tensor([A]), "actor_logps": actor}
    return batch, torch.zeros(1, T, 2)


def test_token_clipped_and_cispo_cases():
    batch, logits = _zero_logit_batch(2.0, 1.0)
    check(L.TokenClippedSurrogateLoss(0.1, 0.1), batch, logits, -1.1)
    batch, logits = _zero_logit_batch(1.0, 2.0)
    check(L.CISPOLoss(), batch, logits, 1.386294, ratio_mean=1.0, clip_frac=0.0, adv_mean=2.0)
    batch, logits = _zero_logit_batch(2.0, 1.0)
    check(L.CISPOLoss(clip_eps_high=0.1), batch, logits, 0.762462, ratio_mean=2.0, clip_frac=1.0)
    batch, logits = _zero_logit_batch(0.1, -1.0)
    check(L.CISPOLoss(), batch, logits, -0.0693147, ratio_mean=0.1, clip_frac=0.0)
    batch, logits = _zero_logit_batch(1.0, 1.0, n_tokens=2)
    ln, sum_ = L.CISPOLoss()(batch, logits=logits), L.CISPOLoss(length_normalize=False)(batch, logits=logits)
    assert float(sum_[0]) == pytest.approx(2 * float(ln[0])) and float(ln[1]["avg_action_tokens"]) == 2.0
    with pytest.raises(KeyError, match="actor_logps"):
        L.CISPOLoss()({k: v for k, v in batch.items() if k != "actor_logps"}, logits=logits)


def test_cispo_gradient_flows_through_logp_when_clipped():
    batch, logits = _zero_logit_batch(2.0, 1.0)
    logits.requires_grad_(True)
    loss, _ = L.CISPOLoss(clip_eps_high=0.5)(batch, logits=logits)
    (g,) = torch.autograd.grad(loss, logits)
    assert float(g.abs().sum()) > 0


class _Mock(L.HeadLoss):
    def __init__(self, value, stats):
        self.value, self.stats = value, stats

    def objective(self, lp, H, tb, with_stats):
        loss = torch.tensor(float(self.value))
        return loss, ({"loss": loss, **{k: torch.tensor(v) for k, v in self.stats.items()}} if with_stats else {})


def test_composite_loss_stats_exactly():
    comp = L.CompositeLoss([L.LossTerm("ppo", _Mock(10, {"clip_frac": 0.1}), 1.0),
                            L.LossTerm("kl", _Mock(4, {"kl_mean": 0.5}), 0.5)])
    batch, logits = _zero_logit_batch(1.0, 1.0)
    loss, stats = comp(batch, logits=logits)
    assert float(loss) == 12.0
    expected = {"loss": 12.0, "ppo/loss": 10.0, "ppo/weight": 1.0, "ppo/clip_frac": 0.1, "kl/loss": 4.0,
                "kl/weight": 0.5, "kl/kl_mean": 0.5}
    assert set(stats) == set(expected)
    assert all(float(stats[k]) == pytest.approx(v) for k, v in expected.items())
    assert isinstance(stats["ppo/weight"], float)


# ----------------------------------------------------------------------------------- hand-derived
def _setup_e(A: float):
    actor = torch.tensor([[0.0, -LN2 - LN2, 0.0]])  # token ratios r = [2.0, 0.5]
    batch = {"input_ids": ids([0, 1, 0]), "action_mask": mask([0, 1, 1]), "weight": torch.tensor([A]),
             "actor_logps": actor, "old_logp_action": actor.sum(1)}
    return batch, torch.zeros(1, 3, 2)


def test_setup_e_token_clipped():
    batch, logits = _setup_e(1.0)
    check(L.TokenClippedSurrogateLoss(0.2, 0.27), batch, logits, -1.77, clip_frac=1.0, ratio_mean=1.25,
          ratio_std=0.75, kl_actor_policy=0.25)
    check(L.TokenClippedSurrogateLoss(0.2, 0.27, True), batch, logits, -0.885)
    batch, logits = _setup_e(-1.0)
    check(L.TokenClippedSurrogateLoss(0.2, 0.27), batch, logits, 2.8)


def test_setup_e_cispo_gspo_kl_ce_entropy():
    batch, logits = _setup_e(1.0)
    check(L.CISPOLoss(), batch, logits, 0.589175, clip_frac=0.5)
    check(L.CISPOLoss(length_normalize=False), batch, logits, 1.178350)
    check(L.CISPOLoss(0.20, 0.28), batch, logits, 0.720873)
    for ln in (False, True):
        check(L.ClippedSurrogateLoss(length_normalize=ln), batch, logits, -1.0)
    check(L.TokenKLLoss(0.01), batch, logits, 0.0, kl_mean=0.0, kl_std=LN2, ratio_mean=1.25)
    check(L.MaskedCausalLMCrossEntropyLoss(), batch, logits, LN2)
    check(L.MaskedCausalLMCrossEntropyLoss(False), batch, logits, 2 * LN2)
    check(L.EntropyBonus(0.01), batch, logits, -0.01 * LN2, entropy_mean=LN2)


# --------------------------------------------------------------------------------- RL-ZVP by hand
def _binary_entropy(d: float) -> float:
    """Entropy of softmax([d, 0])."""
    p = 1.0 / (1.0 + math.exp(-d))
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def _lsm0(d: float) -> float:
    """log softmax([d, 0])[0]."""
    return d - math.log(math.exp(d) + 1.0)


def _zvp_row(ds, direction):
    """One on-policy row: V=2, position j has logits [d_j, 0] and scores token 0; every position after the
    first is an action token; actor_logps = the current log-probs (r = 1)."""
    n = len(ds)
    logits = torch.tensor([[d, 0.0] for d in ds] + [[0.0, 0.0]])
    actor = torch.tensor([0.0] + [_lsm0(d) for d in ds])
    return logits, actor, n, direction


def _zvp_batch(rows, weights):
    T = max(r[2] for r in rows) + 1
    logits = torch.zeros(len(rows), T, 2)
    actor = torch.zeros(len(rows), T)
    am = torch.zeros(len(rows), T)
    for b, (lg, ac, n, _) in enumerate(rows):
        logits[b, : n + 1], actor[b, : n + 1], am[b, 1 : n + 1] = lg, ac, 1.0
    batch = {"input_ids": torch.zeros(len(rows), T, dtype=torch.long), "action_mask": am, "actor_logps": actor,
             "weight": torch.tensor(weights), "zvp_direction": torch.tensor([float(r[3]) for r in rows])}
    return batch, logits


def _zvp_expected(ds, direction, alpha, weight):
    """Hand formula: CISPO per-sequence mean of -A_t lp_t with the RL-ZVP advantage (r = 1)."""
    H = [_binary_entropy(d) for d in ds]
    lp = [_lsm0(d) for d in ds]
    if direction > 0:
        adv = [alpha * h for h in H]
    elif direction < 0:
        adv = [-alpha * (max(H) - h) for h in H]
    else:
        adv = [weight] * len(ds)
    return -sum(a * x for a, x in zip(adv, lp)) / len(ds)


def test_zvp_positive_group():
    row = _zvp_row([0.0, 0.0, 0.0], +1)  # H = ln 2 everywhere: loss = -α ln2 ln(1/2) = α ln²2
    batch, logits = _zvp_batch([row], [0.0])
    check(L.ZVPCISPOLoss(alpha_zvp=0.1), batch, logits, 0.1 * LN2**2, zvp_frac=1.0, zvp_adv_mean=0.1 * LN2)
    assert _zvp_expected([0.0] * 3, +1, 0.1, 0.0) == pytest.approx(0.1 * LN2**2)


@pytest.mark.parametrize("ds", [[3.0, 0.2, 1.5], [1.5, 3.0, 0.2], [3.0, 1.5, 0.2], [0.5, 0.5, 4.0]])
def test_zvp_negative_group_max_at_each_position(ds):
    """The highest-entropy token (smallest |d|) gets advantage 0 wherever it sits; the others are penalised."""
    batch, logits = _zvp_batch([_zvp_row(ds, -1)], [0.0])
    expected = _zvp_expected(ds, -1, 0.1, 0.0)
    H = [_binary_entropy(d) for d in ds]
    adv = [-0.1 * (max(H) - h) for h in H]
    assert expected == pytest.approx(-sum(a * _lsm0(d) for a, d in zip(adv, ds)) / 3)
    assert expected < 0  # negative advantages on negative log-probs: the loss rewards lowering them
    check(L.ZVPCISPOLoss(alpha_zvp=0.1), batch, logits, expected)


def test_zvp_mixed_batch():
    rows = [_zvp_row([0.3, 2.0], +1), _zvp_row([1.0, -0.5, 2.5], -1), _zvp_row([0.7, 1.1, -2.0], 0)]
    weights = [0.0, 0.0, 0.8]
    batch, logits = _zvp_batch(rows, weights)
    expected = sum(_zvp_expected([float(x[0]) for x in r[0][:-1]], r[3], 0.2, w) for r, w in zip(rows, weights)) / 3
    check(L.ZVPCISPOLoss(alpha_zvp=0.2), batch, logits, expected, zvp_frac=2 / 3)
    # direction-0 rows are CISPOLoss exactly
    only_zero = {k: v[2:] for k, v in batch.items()}
    assert float(L.ZVPCISPOLoss(0.2)(only_zero, logits=logits[2:])[0]) == pytest.approx(
        float(L.CISPOLoss()(only_zero, logits=logits[2:])[0])
    )


# -------------------------------------------------------------------------------- ScaleRL by hand
def test_scalerl_prompt_mean_and_absolute_cap():
    """Prompt 0: responses of 1 and 3 tokens; prompt 1: one response of 2 tokens. V=2 zero logits."""
    lens, groups, A = [1, 3, 2], [0, 0, 1], [1.0, -0.5, 2.0]
    ratios = [[5.0], [1.0, 2.0, 0.5], [8.0, 1.0]]  # eps_max = 4 caps 5 and 8
    T = 4
    actor = torch.zeros(3, T)
    am = torch.zeros(3, T)
    for b, (n, rs) in enumerate(zip(lens, ratios)):
        am[b, 1 : n + 1] = 1.0
        actor[b, 1 : n + 1] = torch.tensor([-LN2 - math.log(r) for r in rs])
    batch = {"input_ids": torch.zeros(3, T, dtype=torch.long), "action_mask": am, "actor_logps": actor,
             "weight": torch.tensor(A), "group_id": torch.tensor(groups)}
    lp = -LN2

    def term(b):
        return sum(-min(r, 4.0) * A[b] * lp for r in ratios[b])

    expected = 0.5 * ((term(0) + term(1)) / 4 + term(2) / 2)
    check(L.ScaleRLLoss(), batch, torch.zeros(3, T, 2), expected, clip_frac=2 / 6)
    tb = TokenBatch.from_batch(batch)
    assert int(tb.seqs["n_prompts"]) == 2
