"""Shared cases and the float64 twin of the head-numerics tests (tests/test_head_numerics.py on the torch
backend, tests/interpret/test_head_numerics_kernels.py on the Triton kernels)."""

from __future__ import annotations

import torch

N, D, V = 48, 16, 257


def float64_head(h, w, b, targets, temperature=1.0):
    """(logprob, entropy) of `(h W^T + b) / T` in float64 with 0 log 0 = 0 — independent of the library."""
    z = (h.double() @ w.double().T + b.double()) / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros((), dtype=torch.float64))).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), ent


def confident_rows(offset: float, seed: int = 0):
    """Rows from nearly uniform to one token with all the mass (H from ~1 down to ~1e-12), logits near
    `offset` (a common bias)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g) * torch.logspace(-1, 0.9, N)[:, None]
    w = torch.randn(V, D, generator=g)
    b = torch.full((V,), offset) + 0.1 * torch.randn(V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    return h, w, b, targets


def assert_entropy_exact(ent, ent64):
    ent = ent.detach().double()
    assert bool((ent >= 0).all()), "negative entropy"
    big = ent64 >= 1e-5
    assert big.any() and (~big).any(), "the rows must span both regimes"
    rel = ((ent - ent64).abs() / ent64)[big].max()
    small = (ent - ent64).abs()[~big].max()
    assert rel <= 1e-3 and small <= 1e-7, (float(rel), float(small))


def grads64(h, w, b, targets, g_lp, g_h, keep=None, temperature=1.0):
    """float64 autograd of sum(g_lp lp + g_h H) w.r.t. (h, w, b), on the columns `keep` only (None: all)."""
    x = [t.detach().double().requires_grad_() for t in (h, w, b)]
    hd, wd, bd = x
    cols = torch.arange(w.shape[0]) if keep is None else keep
    remap = torch.full((w.shape[0],), -1, dtype=torch.long)
    remap[cols] = torch.arange(cols.numel())
    lp, ent = float64_head(hd, wd[cols], bd[cols], remap[targets], temperature)
    (g_lp.double() * lp + g_h.double() * ent).sum().backward()
    return lp.detach(), ent.detach(), [t.grad for t in x]


def rel_err(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30))


def masked_case(seed: int = 0):
    """Every third column and the last 40 masked by a bias of -inf; targets on unmasked columns."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.5
    b = torch.randn(V, generator=g)
    masked = torch.zeros(V, dtype=torch.bool)
    masked[::3] = True
    masked[-40:] = True
    b[masked] = float("-inf")
    keep = (~masked).nonzero().squeeze(1)
    targets = keep[torch.randint(0, keep.numel(), (N,), generator=g)]
    return h, w, b, targets, masked, keep


def tied_rows(seed: int = 0):
    """Padded vocabulary rows (zero weight and bias) hold the row maximum 0 five times over (all other logits
    are far below it, in every tile of a kernel): ties of the maximum."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.3
    b = torch.full((V,), -12.0)
    w[-5:], b[-5:] = 0.0, 0.0
    w[100:103], b[100:103] = 0.0, 0.0  # three more zero rows in an earlier vocabulary tile
    targets = torch.randint(0, V, (N,), generator=g)
    return h, w, b, targets


def check_vocab_parallel(rank: int, world: int) -> None:
    """On rank `rank` of a vocab-parallel group: confident rows at logit offset 1e3 (entropy exact), and a
    masked vocabulary whose second shard is masked whole (values and gradients finite and exact)."""
    from ludic_fast.distributed import vocab_parallel_linear_logprobs, vocab_partition

    start, stop = vocab_partition(V, world, rank)
    h, w, b, targets = confident_rows(1e3)
    out = vocab_parallel_linear_logprobs(h, w[start:stop], targets, bias=b[start:stop], process_group=None,
                                         vocab_start=start, vocab_size=V, chunk_elements=16 * 40)  # vocabulary slices
    assert_entropy_exact(out.entropy, float64_head(h, w, b, targets)[1])
    h, w, b, targets, masked, keep = masked_case()
    second = vocab_partition(V, world, 1)[0]
    b[second:] = float("-inf")
    keep = keep[keep < second]
    targets = keep[torch.arange(N) % keep.numel()]
    leaves = [t.clone().requires_grad_() for t in (h, w[start:stop], b[start:stop])]
    out = vocab_parallel_linear_logprobs(leaves[0], leaves[1], targets, bias=leaves[2], process_group=None,
                                         vocab_start=start, vocab_size=V)
    lp64, ent64, (dh64, dw64, db64) = grads64(h, w, b, targets, torch.ones(N), torch.ones(N), keep)
    torch.testing.assert_close(out.entropy.double(), ent64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logprobs.double(), lp64, rtol=1e-5, atol=1e-5)
    dh, dw, db = torch.autograd.grad((out.logprobs + out.entropy).sum(), leaves)
    assert rel_err(dh, dh64) <= 1e-5 and rel_err(dw, dw64[start:stop]) <= 1e-5 and rel_err(db, db64[start:stop]) <= 1e-5

