"""The workspace row kernel as a drop-in for `ChunkedHead.stats` + `ChunkedHead.grad_raw_` (under
TRITON_INTERPRET=1), with fp32 and bf16 workspaces, whole rows and vocabulary slices; and the strategy rule."""

from __future__ import annotations

import pytest
import torch
from _interp import DEVICE, MARKS

from ludic_fast.ops.torch_head import ChunkedHead, HeadTransform

pytestmark = MARKS

N, V, D = 6, 1021, 40


def _setup(softcap, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.4
    b = torch.randn(V, generator=g) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    targets[2] = -100
    inv_t = (torch.rand(N, generator=g) + 0.4).double().reciprocal()
    transform = HeadTransform(1.3, softcap, inv_t)
    head = ChunkedHead(h, w, b, targets, transform, None, -100)
    g_lp = torch.randn(N, generator=g) * head.valid
    g_h = torch.randn(N, generator=g) * head.valid
    return h, w, b, targets, transform, head, g_lp, g_h


def _rows(ws, targets, transform, b, **kw):
    from ludic_fast.ops.triton_head import workspace_head_rows_

    return workspace_head_rows_(ws, targets.to(DEVICE), transform.inv_temperature.to(DEVICE), bias=b.to(DEVICE),
                                logit_scale=transform.logit_scale, softcap=transform.softcap, **kw)


@pytest.mark.parametrize("ws_dtype", [torch.float32, torch.bfloat16], ids=["fp32-ws", "bf16-ws"])
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["nocap", "softcap"])
def test_stats_and_grad_in_one_call(ws_dtype, softcap):
    h, w, b, targets, transform, head, g_lp, g_h = _setup(softcap)
    raw = h @ w.T  # the GEMM the caller runs (no bias, no transform)
    ws = raw.to(ws_dtype).to(DEVICE)
    # reference on the same (possibly bf16-rounded) raw logits: final logits, their statistics, ChunkedHead.grad_raw_
    rows, cols = slice(0, N), slice(0, V)
    z_ref = transform.apply_(ws.float().cpu() + b, rows)
    lse_ref = torch.logsumexp(z_ref, 1)
    p_ref = torch.softmax(z_ref.double(), 1)
    elp_ref = (p_ref * z_ref).sum(1).float() - lse_ref
    h_ref = -(p_ref * torch.log_softmax(z_ref.double(), 1)).sum(1).float()
    zy_ref = z_ref.gather(1, head.targets[:, None]).squeeze(1)
    d_ref = head.grad_raw_(z_ref.clone(), rows, cols, lse_ref, elp_ref, g_lp, g_h)
    lse, elp, zy, ent = _rows(ws, targets, transform, b, g_lp=g_lp.to(DEVICE), g_H=g_h.to(DEVICE))
    torch.testing.assert_close(lse.cpu(), lse_ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(elp.cpu(), elp_ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(ent.cpu(), h_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(zy.cpu(), zy_ref * head.valid, atol=1e-5, rtol=1e-6)
    assert ws.dtype == ws_dtype
    tol = 1e-5 if ws_dtype == torch.float32 else 8e-3  # bf16 workspace: d(raw) is stored rounded to bf16
    assert (ws.float().cpu() - d_ref).abs().max() <= tol * d_ref.abs().max()
    assert bool((ws[2] == 0).all()), "ignored row must get a zero gradient"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16-out", "fp16-out"])
def test_grad_written_in_operand_dtype_over_the_workspace(out_dtype):
    """fp32 raw logits in, d(raw) out as bf16/fp16 over the same memory (operand_view): the d(raw) of every
    row equals the fp32 result rounded once; rows are wider than one kernel block (BLOCK_V) so later blocks
    store over bytes that earlier blocks read, and the padded row stride (new_workspace) is kept."""
    from ludic_fast.kernels.head_rows import BLOCK_V

    from ludic_fast.ops.triton_head import new_workspace, operand_view

    h, w, b, targets, transform, head, g_lp, g_h = _setup(4.0, seed=2)
    w2 = torch.cat([w] * (BLOCK_V // V + 2))[: 2 * BLOCK_V + 77]  # 8269 columns: 3 blocks, not a multiple of 128
    bias = torch.cat([b] * (BLOCK_V // V + 2))[: w2.shape[0]]
    raw = h @ w2.T
    ref_ws = raw.clone().to(DEVICE)
    lse, elp, zy, _ = _rows(ref_ws, targets, transform, bias, g_lp=g_lp.to(DEVICE), g_H=g_h.to(DEVICE))  # in place
    ws = new_workspace(N, w2.shape[0], DEVICE)
    assert ws.stride(0) % 128 == 0 and ws.stride(0) > ws.shape[1]
    ws.copy_(raw)
    d = operand_view(ws, out_dtype)
    assert d.data_ptr() == ws.data_ptr() and d.dtype == out_dtype and d.shape == ws.shape
    lse2, elp2, zy2, _ = _rows(ws, targets, transform, bias, g_lp=g_lp.to(DEVICE), g_H=g_h.to(DEVICE), out=d)
    assert torch.equal(lse2, lse) and torch.equal(elp2, elp) and torch.equal(zy2, zy)
    # one rounding of the fp32 d(raw): within one ulp of the operand dtype (the interpreter's cast truncates,
    # GPUs round to nearest)
    ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(d.float().cpu(), ref_ws.cpu(), rtol=ulp, atol=1e-7)


def test_out_must_not_overlap_the_workspace_otherwise():
    from ludic_fast.ops.triton_head import operand_view

    h, w, b, targets, transform, head, g_lp, g_h = _setup(None)
    ws = (h @ w.T).to(DEVICE)
    shifted = ws.view(torch.bfloat16)[:, 1 : V + 1]
    with pytest.raises(ValueError, match="overlaps ws"):
        _rows(ws, targets, transform, b, g_lp=g_lp.to(DEVICE), out=shifted)
    with pytest.raises(ValueError, match="cannot view"):
        operand_view(ws.to(torch.bfloat16), torch.float32)


def test_grad_on_vocabulary_slice_with_given_stats():
    h, w, b, targets, transform, head, g_lp, g_h = _setup(5.0, seed=1)
    rows = slice(0, N)
    lse, elp, _, _ = head.stats(h, rows, True)
    cols = slice(300, 700)
    z = head.logits(h, rows, cols)
    d_ref = head.grad_raw_(z, rows, cols, lse, elp, g_lp, g_h)
    ws = (h @ w[cols].T).to(DEVICE)
    lse_out, elp_out, zy, ent = _rows(ws, targets, transform, b, col_start=cols.start, lse=lse.to(DEVICE),
                                      elp=elp.to(DEVICE), g_lp=g_lp.to(DEVICE), g_H=g_h.to(DEVICE))
    assert zy is None and ent is None and torch.equal(lse_out.cpu(), lse.float())
    torch.testing.assert_close(ws.cpu(), d_ref, atol=1e-7, rtol=1e-5)


def test_bad_arguments():
    h, w, b, targets, transform, _, g_lp, g_h = _setup(None)
    ws = (h @ w[:100].T).to(DEVICE)
    with pytest.raises(ValueError, match="whole vocabulary rows"):
        _rows(ws, targets, transform, b)
    with pytest.raises(ValueError, match="g_H needs g_lp"):
        _rows((h @ w.T).to(DEVICE), targets, transform, b, g_H=g_h.to(DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        _rows((w @ h.T).to(DEVICE).T, targets, transform, b)
