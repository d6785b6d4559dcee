"""Cost model and robustness of the fused losses: matmul FLOPs (6NDV token-local, 8NDV coupled), no tensor of
N*V elements, micro-batch invariance, degenerate batches, NaN propagation."""

from __future__ import annotations

import functools

import pytest
import torch
from _alloc import HostSyncs, LargestAllocation
from test_losses_common import CASE_IDS, CASES, make_batch
from torch.utils.flop_counter import FlopCounterMode

from ludic_fast import losses as L
from ludic_fast import reference as R
from ludic_fast.losses.preference.common import group_starts
from ludic_fast.token_batch import TokenBatch, attach_action_rows


def _big_batch(seed=0, B=4, T=40, D=24, V=160):
    """Most positions are action tokens; N (action tokens) > D so that dW [V, D] is smaller than N x V."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    W = torch.randn(V, D, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T)
    am[:, :4] = 0.0
    actor = torch.randn(B, T, generator=g) * 0.1 - 5.0
    batch = {"input_ids": ids, "action_mask": am, "weight": torch.randn(B, generator=g), "actor_logps": actor * am,
             "old_logp_action": (actor * am).sum(1), "ref_logps": actor * am, "group_id": torch.tensor([0, 0, 1, 1]),
             "zvp_direction": torch.tensor([1.0, 0.0, -1.0, 0.0]), "is_weights": torch.ones(B, T)}
    N = int(am[:, 1:].sum())
    return batch, h, W, N


TOKEN_LOCAL = ["cispo", "token_clipped", "sft", "token_kl", "kl", "entropy_bonus", "scalerl", "sapo", "composite",
               "ppo_token_mean_dual_k3is", "cispo_seqnorm_tis_seq"]
COUPLED = ["reinforce", "reinforce_baseline", "gspo", "gspo_token", "zvp_cispo", "ppo_zvp_toprho",
           "composite_coupled"]


def _loss(name):
    return CASES[CASE_IDS.index(name)][1]


def _flops(loss_fn, batch, h, W, **kw):
    with FlopCounterMode(display=False) as fc:
        loss, _ = loss_fn(batch, hidden=h, weight=W, **kw)
        loss.backward()
    return fc.get_total_flops()


def _with_sequence_starts(batch: dict) -> dict:
    """The batch with its action rows, target bounds and sequence starts attached as the trainer's collation
    attaches them (here from TokenBatch's own device index, where its sequence id changes: `group_starts`)."""
    tb = TokenBatch.from_batch(batch)
    out = dict(batch)
    attach_action_rows(out, tb.rows, (int(tb.targets.min()), int(tb.targets.max())), group_starts(tb.seq))
    return out


@pytest.mark.parametrize("name", ["reinforce", "reinforce_ln", "reinforce_baseline", "gspo", "gspo_token",
                                  "zvp_cispo"])
def test_sequence_coupled_losses_run_one_pass_over_whole_sequences(name):
    """A loss coupled only within a sequence, given the sequences' starts on the host (the trainer's collation):
    chunks of whole sequences, one pass, 6NDV where the same chunking without them takes two passes (8NDV);
    the same loss and gradients. make_batch's sequences have 7, 4, 0 and 7 action tokens: 16-row chunks."""
    batch, h, W, b = make_batch(0)
    loss_fn = _loss(name)
    assert loss_fn.coupling_groups(TokenBatch.from_batch(batch)) is None  # no starts known: two passes
    n, D, V = int(TokenBatch.from_batch(batch).n), h.shape[-1], W.shape[0]
    results = {}
    for kind, data in (("starts", _with_sequence_starts(batch)), ("plain", batch)):
        assert _flops(loss_fn, data, h, W, chunk_elements=16 * V) == (6 if kind == "starts" else 8) * n * D * V
        h.grad = W.grad = None
        loss, _ = loss_fn(data, hidden=h, weight=W, chunk_elements=16 * V)
        loss.backward()
        results[kind] = (loss.detach(), h.grad.clone(), W.grad.clone())
    for one, two in zip(results["starts"], results["plain"]):
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)


def test_top_rho_couples_the_whole_batch_even_with_sequence_starts():
    batch, h, W, b = make_batch(0)
    tb = TokenBatch.from_batch(_with_sequence_starts(batch))
    assert tb.sequence_starts() == [7, 11] and _loss("zvp_cispo").coupling_groups(tb) == [7, 11]
    assert _loss("ppo_zvp_toprho").coupling_groups(tb) is None


@pytest.mark.parametrize("name", COUPLED)
def test_a_coupled_loss_in_one_chunk_is_6ndv(name):
    """One chunk of all N rows: the gradient pass takes the statistics pass's chunk, logits and all (no second
    logits GEMM); the loss and gradients equal the two-chunk run's."""
    batch, h, W, N = _big_batch()
    loss_fn = _loss(name)
    D, V = h.shape[-1], W.shape[0]
    assert _flops(loss_fn, batch, h, W, chunk_elements=N * V) == 6 * N * D * V
    grads = []
    for chunk in (N * V, 16 * V):
        h.grad = W.grad = None
        loss, _ = loss_fn(batch, hidden=h, weight=W, chunk_elements=chunk)
        loss.backward()
        grads.append((loss.detach(), h.grad.clone(), W.grad.clone()))
    for one, two in zip(*grads):
        torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", TOKEN_LOCAL + COUPLED)
def test_fused_flops_are_6ndv_token_local_8ndv_coupled(name):
    batch, h, W, N = _big_batch()
    loss_fn = _loss(name)
    assert loss_fn.coupled == (name in COUPLED)
    D, V = h.shape[-1], W.shape[0]
    flops = _flops(loss_fn, batch, h, W, chunk_elements=16 * V)  # 16-token chunks: N / 16 chunks
    expected = (8 if name in COUPLED else 6) * N * D * V
    assert abs(flops - expected) <= 0.01 * expected, (flops / (N * D * V))


@pytest.mark.parametrize("name", ["cispo", "zvp_cispo"])
def test_sliced_vocabulary_is_8ndv(name):
    """Budget below 16 whole rows: vocabulary slices, statistics sweep then gradient sweep (both 8NDV)."""
    batch, h, W, N = _big_batch()
    D, V = h.shape[-1], W.shape[0]
    flops = _flops(_loss(name), batch, h, W, chunk_elements=8 * V)
    assert abs(flops - 8 * N * D * V) <= 0.01 * 8 * N * D * V, flops / (N * D * V)


def test_generic_path_is_8ndv():
    batch, h, W, N = _big_batch()
    flops = _flops(L.CISPOLoss(), batch, h, W, fused=False, chunk_elements=16 * W.shape[0])
    assert abs(flops - 8 * N * h.shape[-1] * W.shape[0]) <= 0.01 * 8 * N * h.shape[-1] * W.shape[0]


@pytest.mark.parametrize("name", ["cispo", "zvp_cispo", "composite", "ppo_zvp_toprho"])
@pytest.mark.parametrize("fused", [True, False])
def test_no_tensor_of_n_by_v_elements(name, fused):
    batch, h, W, N = _big_batch()
    V = W.shape[0]
    assert V * h.shape[-1] < N * V
    with LargestAllocation() as rec:
        loss, _ = _loss(name)(batch, hidden=h, weight=W, fused=fused, chunk_elements=16 * V)
        loss.backward()
    assert rec.largest < N * V, (rec.largest, rec.op)
    assert rec.largest >= 16 * V  # the chunk itself was seen: the recorder works


# ------------------------------------------------------------------------------ micro-batch invariance
# Invariant under the trainer's rule (micro-loss x items/N, summed): every loss that averages per-sequence
# values over the micro-batch rows. NOT invariant, by their semantics:
#   ReinforceBaselineLoss    the baseline (and std) are micro-batch statistics;
#   EntropyBonus, aggregation='token_mean' / 'prompt_mean' (ScaleRLLoss)
#                            on a bare micro-batch the denominators are its own token / prompt counts
#                            (invariant here only because the halves hold whole prompts of equal size);
#                            with the trainer's macro-batch totals in the batch (or a global `normalizer`,
#                            summed unscaled) they are invariant for any split: checked below;
#   entropy_top_rho          the entropy quantile is taken over the micro-batch;
#   any caller `normalizer`  already global: sum the micro-losses unscaled (checked below), do not scale.
INVARIANT = ["reinforce", "reinforce_ln", "sft", "gspo", "gspo_token", "token_clipped", "token_clipped_ln_delta",
             "cispo", "token_kl", "kl", "zvp_cispo", "scalerl", "sapo", "ppo_drgrpo_tis_k2", "composite_coupled"]


def _split(batch, rows):
    return {k: v[rows] for k, v in batch.items()}


def _grads(loss_fn, parts, h, W, b):
    total = None
    for batch, rows, scale in parts:
        loss, _ = loss_fn(batch, hidden=h[rows], weight=W, bias=b, chunk_elements=3 * 37)
        total = loss * scale if total is None else total + loss * scale
    return total, torch.autograd.grad(total, (h, W, b))


@pytest.mark.parametrize("name", INVARIANT)
def test_micro_batch_invariance(name):
    loss_fn = _loss(name)
    batch, h, W, b = make_batch(2)
    full, g_full = _grads(loss_fn, [(batch, slice(None), 1.0)], h, W, b)
    halves = [slice(0, 2), slice(2, 4)]  # whole prompts (group_id 7 7 | 3 3)
    split, g_split = _grads(loss_fn, [(_split(batch, s), s, 0.5) for s in halves], h, W, b)
    assert float(split.detach()) == pytest.approx(float(full.detach()), rel=1e-5, abs=1e-6)
    for a, c in zip(g_split, g_full):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_token_mean_with_global_normalizer_sums_exactly():
    batch, h, W, b = make_batch(2)
    n_tok = float(batch["action_mask"][:, 1:].sum())
    loss_fn = L.CISPOLoss(aggregation="token_mean", normalizer=n_tok)
    full, g_full = _grads(loss_fn, [(batch, slice(None), 1.0)], h, W, b)
    parts = [(_split(batch, s), s, 1.0) for s in (slice(0, 1), slice(1, 4))]
    split, g_split = _grads(loss_fn, parts, h, W, b)
    assert float(split.detach()) == pytest.approx(float(full.detach()), rel=1e-5)
    for a, c in zip(g_split, g_full):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    local = L.CISPOLoss(aggregation="token_mean")(batch, logits=R.head_logits(h, W, b))[0]
    assert float(local.detach()) == pytest.approx(float(full.detach()), rel=1e-5)


# ------------------------------------------------------------------------- macro-batch totals (trainer)
MACRO_AGGREGATED = ["ppo_token_mean_dual_k3is", "sapo_token_mean_entropy", "scalerl", "ppo_prompt_mis_seq_entropy",
                    "entropy_bonus"]


def _with_macro_totals(batch, rows):
    """Micro-batch `rows` of `batch` carrying the totals of the whole batch (hand-computed, token_batch.py)."""
    n = batch["action_mask"][:, 1:].sum(-1)  # scored tokens per sequence
    groups = batch["group_id"]
    B = groups.numel()
    part = _split(batch, rows)
    part["macro_tokens_per_seq"] = n.sum().clamp(min=1.0) / B
    part["macro_prompts_per_seq"] = torch.tensor(torch.unique(groups).numel() / B)
    part["macro_prompt_tokens"] = torch.stack([n[groups == g].sum() for g in groups])[rows]
    return part


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", MACRO_AGGREGATED)
def test_macro_totals_make_token_and_prompt_means_split_invariant(name, fused):
    """token_mean / prompt_mean (and EntropyBonus's mean) with the trainer's macro-batch totals: any split (one
    that cuts prompt 7 in two and leaves micro-batches of unequal size), weighted by items / N, gives the
    whole-batch loss."""
    batch, h, W, b = make_batch(3)
    loss_fn = functools.partial(_loss(name), fused=fused)
    full, g_full = _grads(loss_fn, [(batch, slice(None), 1.0)], h, W, b)
    parts = [(_with_macro_totals(batch, s), s, (s.stop - s.start) / 4) for s in (slice(0, 1), slice(1, 4))]
    split, g_split = _grads(loss_fn, parts, h, W, b)
    assert float(split.detach()) == pytest.approx(float(full.detach()), rel=1e-5, abs=1e-6)
    for a, c in zip(g_split, g_full):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    without, _ = _grads(loss_fn, [(_split(batch, s), s, w) for _, s, w in parts], h, W, b)
    assert abs(float(without.detach()) - float(full.detach())) > 1e-4  # the per-micro-batch means differ


@pytest.mark.parametrize("name", MACRO_AGGREGATED)
def test_macro_totals_match_the_reference(name):
    _, loss_fn, ref_fn = CASES[CASE_IDS.index(name)]
    batch, h, W, b = make_batch(4)
    part = _with_macro_totals(batch, slice(1, 4))
    loss, _ = loss_fn(part, hidden=h[1:4], weight=W, bias=b)
    ref, _ = ref_fn(part, logits=R.head_logits(h[1:4], W, b))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    for x, y in zip(torch.autograd.grad(loss, (h, W)), torch.autograd.grad(ref, (h, W))):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_macro_totals_come_together():
    batch, h, W, b = make_batch(0)
    batch["macro_tokens_per_seq"] = torch.tensor(3.0)
    with pytest.raises(ValueError, match="macro-batch totals come together"):
        L.CISPOLoss(aggregation="token_mean")(batch, hidden=h, weight=W, bias=b)


# ------------------------------------------------------------------------------------------ host syncs
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["cispo", "scalerl", "zvp_cispo", "gspo", "ppo_token_mean_dual_k3is"])
def test_two_host_syncs_per_loss_call(name, fused):
    """TokenBatch's `nonzero` (the number of action tokens) and the target range check; nothing else waits for
    the device, forward or backward, token-local or coupled."""
    batch, h, W, b = make_batch(0)
    with HostSyncs() as rec:
        loss, _ = _loss(name)(batch, hidden=h, weight=W, bias=b, fused=fused, chunk_elements=3 * 37)
        loss.backward()
    assert sorted(rec.ops) == ["_local_scalar_dense", "nonzero"]


# ------------------------------------------------------------------------------------ degenerate batches
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_all_masked_batch_is_finite_with_zero_grads(case, fused):
    _, loss_fn, ref_fn = case
    batch, h, W, b = make_batch(4)
    batch["action_mask"] = torch.zeros_like(batch["action_mask"])
    loss, stats = loss_fn(batch, hidden=h, weight=W, bias=b, fused=fused)
    ref_loss, _ = ref_fn(batch, logits=R.head_logits(h, W, b))
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    assert all(torch.isfinite(v).all() for v in stats.values() if isinstance(v, torch.Tensor))
    for g in torch.autograd.grad(loss, (h, W, b), allow_unused=True, materialize_grads=True):
        assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("name", ["cispo", "token_clipped", "zvp_cispo", "gspo", "scalerl", "ppo_zvp_toprho"])
def test_single_token_batch_matches_reference(name):
    _, loss_fn, ref_fn = CASES[CASE_IDS.index(name)]
    batch, h, W, b = make_batch(6)
    am = torch.zeros_like(batch["action_mask"])
    am[1, 4] = 1.0
    batch["action_mask"] = am
    loss, _ = loss_fn(batch, hidden=h, weight=W, bias=b)
    ref_loss, _ = ref_fn(batch, logits=R.head_logits(h, W, b))
    g, rg = torch.autograd.grad(loss, (h, W)), torch.autograd.grad(ref_loss, (h, W))
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-5, abs=1e-7)
    for a, c in zip(g, rg):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(g[0].abs().sum(-1)) <= 1  # only the one scoring position can get a gradient


@pytest.mark.parametrize("name", ["cispo", "token_clipped", "gspo", "reinforce", "scalerl", "sapo"])
def test_zero_advantage_gives_zero_loss_and_grads(name):
    batch, h, W, b = make_batch(7)
    batch["weight"] = torch.zeros_like(batch["weight"])
    loss, _ = _loss(name)(batch, hidden=h, weight=W, bias=b)
    assert float(loss.detach()) == 0.0
    for g in torch.autograd.grad(loss, (h, W, b)):
        assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["cispo", "zvp_cispo", "entropy_bonus"])
def test_nan_in_hidden_propagates(name, fused):
    batch, h, W, b = make_batch(8)
    with torch.no_grad():
        h[0, 4, 3] = float("nan")  # an action position (row 0 acts from position 1)
    loss, _ = _loss(name)(batch, hidden=h, weight=W, bias=b, fused=fused)
    assert torch.isnan(loss)
    g_h, g_w = torch.autograd.grad(loss, (h, W))
    assert torch.isnan(g_w).any() and torch.isnan(g_h).any()


def test_nan_at_a_prompt_position_never_enters_the_head():
    batch, h, W, b = make_batch(8)
    with torch.no_grad():
        h[0, 8, 3] = float("nan")  # row 0 has length 9: position 8 scores nothing
    loss, _ = L.CISPOLoss()(batch, hidden=h, weight=W, bias=b)
    assert torch.isfinite(loss)


def test_fused_backward_twice_is_refused():
    batch, h, W, b = make_batch(0)
    loss, _ = L.CISPOLoss()(batch, hidden=h, weight=W, bias=b)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def test_stats_are_detached_zero_dim_and_loss_scales_grad_output():
    batch, h, W, b = make_batch(0)
    loss, stats = L.CISPOLoss()(batch, hidden=h, weight=W, bias=b)
    assert all(v.ndim == 0 and not v.requires_grad for v in stats.values())
    (g1,) = torch.autograd.grad(3.0 * loss, (W,))
    loss2, _ = L.CISPOLoss()(batch, hidden=h, weight=W, bias=b)
    (g2,) = torch.autograd.grad(loss2, (W,))
    torch.testing.assert_close(g1, 3.0 * g2)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fused_mode_evaluates_the_objective_on_all_tokens_once(case, monkeypatch):
    """The fused mode's stats come from the head's one call of the objective on all tokens (one token chunk
    here: the gradient call itself), not from another evaluation after it; they equal the generic mode's."""
    _, ours, _ = case
    batch, h, W, _ = make_batch()
    calls = []
    objective = type(ours).objective

    def counted(self, lp, H, tb, with_stats):
        calls.append(with_stats)
        return objective(self, lp, H, tb, with_stats)

    monkeypatch.setattr(type(ours), "objective", counted)
    loss, stats = ours(batch, hidden=h, weight=W)
    assert calls == [True], calls
    _, generic = ours(batch, hidden=h, weight=W, fused=False)
    assert stats.keys() == generic.keys()
    for key, value in stats.items():
        torch.testing.assert_close(value, generic[key], rtol=1e-5, atol=1e-6, msg=key)
