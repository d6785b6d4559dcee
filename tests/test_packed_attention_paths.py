"""The packed-attention kernels of bench/packed_attention.py (the library's dense mask, per-sequence SDPA loop,
jagged SDPA, flex BlockMask; the padded batch) against float64 softmax attention of each sequence alone, on
every path the CPU runs: fp32 outputs and dq / dk / dv within 1e-5 of it (GQA, a one-token sequence, a sequence
longer than a flex tile); flex forward only (no CPU backward); the jagged path's layout (offsets, transposes)
with the CUDA-only kernel replaced by per-sequence SDPA; and the bench's rows and refusals."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _scripts import load_script

from ludic_fast.integrations import sdpa_varlen

BENCH = Path(__file__).resolve().parents[1] / "bench" / "packed_attention.py"
LENGTHS = [5, 1, 140, 12]
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _bench():
    return load_script(BENCH, "packed_attention_bench")


def _case(bench, dtype=torch.float32):
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    return cu, bench.inputs(LENGTHS, HEADS, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), seed=3)


CPU_PATHS = ["padded-causal", "padded-mask", "dense-mask", "sdpa-loop"]


@pytest.mark.parametrize("path", CPU_PATHS)
def test_path_equals_float64_attention(path):
    bench = _bench()
    assert bench.unavailable(path, torch.device("cpu"), torch.float32, HEAD_DIM) is None
    setup, run = bench.make_path(path, bench.Layer(HEADS, KV_HEADS))
    cu, (q, k, v, grad) = _case(bench)
    errors = bench.errors(run, setup(cu, torch.device("cpu")), q, k, v, grad, LENGTHS)
    assert max(errors.values()) <= 1e-5, errors


def test_flex_forward_equals_float64_attention():
    torch._dynamo.reset()
    bench = _bench()
    setup, run = bench.make_path("flex", bench.Layer(HEADS, KV_HEADS))
    cu, (q, k, v, _) = _case(bench)
    with torch.no_grad():
        out = run(q, k, v, setup(cu, torch.device("cpu")))
    ref = bench.reference_attention(q, k, v, LENGTHS)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-5


def _per_component_sdpa(q, k, v, dropout_p=0.0, scale=None, is_causal=False):
    """Stand-in for the CUDA jagged kernel: causal SDPA of each component, returned as a jagged tensor."""
    assert q.is_nested and is_causal
    outs = [F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale).transpose(0, 1)
            for a, b, c in zip(q.unbind(), k.unbind(), v.unbind())]
    return torch.nested.nested_tensor_from_jagged(torch.cat(outs), q.offsets()).transpose(1, 2)


def test_jagged_path_layout_with_the_kernel_replaced(monkeypatch):
    """`sdpa_varlen._nested` builds [S, heads, j, d] jagged q / k / v from the packed row and returns
    [1, total, heads, d], gradients flowing back to the row; the kernel (CUDA only for causal jagged SDPA) is
    replaced by per-sequence SDPA."""
    bench = _bench()
    monkeypatch.setattr(sdpa_varlen, "F", types.SimpleNamespace(scaled_dot_product_attention=_per_component_sdpa))
    cu, (q, k, v, grad) = _case(bench)
    groups = HEADS // KV_HEADS

    def run(q, k, v, state):
        out = sdpa_varlen._nested(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu, 0.0, None)
        assert out.shape == (1, sum(LENGTHS), HEADS, HEAD_DIM)
        return out[0]

    errors = bench.errors(run, {}, q, k, v, grad, LENGTHS)
    assert max(errors.values()) <= 1e-5, errors


def test_jagged_path_under_autocast_computes_in_its_dtype(monkeypatch):
    """fp32 q / k / v under bf16 autocast (RoPE leaves q in fp32 with fp32 weights): the jagged path runs in bf16,
    as autocast runs SDPA, and matches float64 to bf16 rounding (2^-7 relative, several roundings)."""
    bench = _bench()
    seen = []

    def recording(q, k, v, **kw):
        seen.append((q.dtype, torch.is_autocast_enabled("cpu")))
        return _per_component_sdpa(q, k, v, **kw)

    monkeypatch.setattr(sdpa_varlen, "F", types.SimpleNamespace(scaled_dot_product_attention=recording))
    cu, (q, k, v, _) = _case(bench)
    groups = HEADS // KV_HEADS
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa_varlen._nested(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu, 0.0, None)
    assert seen == [(torch.bfloat16, False)] and out.dtype == torch.bfloat16
    ref = bench.reference_attention(q, k, v, LENGTHS)
    assert float((out[0].double() - ref).abs().max() / ref.abs().max()) <= 2e-2


def _flash_stand_in(calls: list, gqa: bool):
    """Stand-in for `torch.nn.attention.varlen.varlen_attn` (its flash kernel is CUDA only), from its documented
    contract: q [T, H, d], k / v [T, H_kv, d] (H_kv < H only with enable_gqa), int32 offsets, key k of query q
    attended when left >= q - k >= -right within q's sequence (window_size = (left, right), -1: unbounded)."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append({"cu": cu_q.dtype, "same": cu_k is cu_q, "max": (max_q, max_k), "window": window_size,
                      "gqa": enable_gqa, "kv_heads": k.shape[1], "contiguous": q.is_contiguous()})
        assert enable_gqa == gqa and (enable_gqa or k.shape[1] == q.shape[1])
        left, right = window_size
        outs = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
            ks, vs = (x.repeat_interleave(q.shape[1] // k.shape[1], 0) for x in (ks, vs))
            lag = torch.arange(b - a)[:, None] - torch.arange(b - a)[None, :]
            allowed = (lag >= -right if right >= 0 else True) & (lag <= left if left >= 0 else True)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed & (lag >= -max(right, 0)),
                                                       scale=scale).transpose(0, 1))
        return torch.cat(outs)

    return varlen_attn


@pytest.mark.parametrize("gqa", [True, False], ids=["enable_gqa", "kv-repeated"])
def test_flash_varlen_path_layout_with_the_kernel_replaced(monkeypatch, gqa):
    """`sdpa_varlen._flash_varlen` hands the packed row to PyTorch's flash varlen entry point as [total, heads, d]
    with int32 offsets, the longest sequence and causal `window_size=(-1, 0)`, GQA by `enable_gqa` where the entry
    point takes it (else kv heads repeated), and returns [1, total, heads, d] with gradients to the row; the
    CUDA-only kernel replaced by a stand-in of its contract."""
    bench, calls = _bench(), []
    monkeypatch.setattr(sdpa_varlen, "varlen_attn", _flash_stand_in(calls, gqa))
    params = {"window_size": None, **({"enable_gqa": None} if gqa else {})}
    monkeypatch.setattr(sdpa_varlen, "_VARLEN_PARAMS", params)
    cu, (q, k, v, grad) = _case(bench)

    def run(q, k, v, state):
        out = sdpa_varlen._flash_varlen(q, k, v, sdpa_varlen._Split(cu), HEADS // KV_HEADS, None, None)
        assert out.shape == (1, sum(LENGTHS), HEADS, HEAD_DIM)
        return out[0]

    errors = bench.errors(run, {}, q, k, v, grad, LENGTHS)
    assert max(errors.values()) <= 1e-5, errors
    assert calls[0] == {"cu": torch.int32, "same": True, "max": (max(LENGTHS),) * 2, "window": (-1, 0), "gqa": gqa,
                        "kv_heads": KV_HEADS if gqa else HEADS, "contiguous": True}


def test_flash_varlen_sliding_window_keeps_what_transformers_keeps(monkeypatch):
    """A sliding window w keeps keys q - w < k <= q (transformers' masks; the per-sequence loop): the flash entry
    point gets window_size (w - 1, 0), and the row's output equals the loop's."""
    bench, calls = _bench(), []
    monkeypatch.setattr(sdpa_varlen, "varlen_attn", _flash_stand_in(calls, False))
    monkeypatch.setattr(sdpa_varlen, "_VARLEN_PARAMS", {"window_size": None})
    cu, (q, k, v, _) = _case(bench)
    groups, window = HEADS // KV_HEADS, 7
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = sdpa_varlen._flash_varlen(q, k, v, sdpa_varlen._Split(cu), 1, window, None)
    want = sdpa_varlen._loop(q, k, v, LENGTHS, window, 0.0, None, {})
    assert calls[0]["window"] == (window - 1, 0)
    assert torch.allclose(out, want, atol=1e-6, rtol=0)


def test_flash_varlen_applies_only_where_the_kernel_does():
    """CUDA, half precision (or autocast to it), no dropout, head dim 8..256 in steps of 8, no empty sequence."""
    def query(dtype=torch.bfloat16, cuda=True, head_dim=64):
        device = torch.device("cuda" if cuda else "cpu")
        return types.SimpleNamespace(is_cuda=cuda, device=device, dtype=dtype, shape=(1, HEADS, 8, head_dim))

    has_it = "window_size" in sdpa_varlen._VARLEN_PARAMS
    assert sdpa_varlen.flash_varlen_applies(query(), [3, 5], 0.0) is has_it
    assert not sdpa_varlen.flash_varlen_applies(query(cuda=False), [3, 5], 0.0)
    assert not sdpa_varlen.flash_varlen_applies(query(dtype=torch.float32), [3, 5], 0.0)
    assert not sdpa_varlen.flash_varlen_applies(query(), [3, 5], 0.1)
    assert not sdpa_varlen.flash_varlen_applies(query(head_dim=12), [3, 5], 0.0)
    assert not sdpa_varlen.flash_varlen_applies(query(head_dim=264), [3, 5], 0.0)
    assert not sdpa_varlen.flash_varlen_applies(query(), [3, 0, 5], 0.0)


def test_jagged_path_is_not_chosen_on_the_cpu():
    q = torch.zeros(1, HEADS, 8, HEAD_DIM, dtype=torch.bfloat16)
    assert not sdpa_varlen.nested_applies(q, [3, 5], None)


def test_bench_rows_on_cpu(tmp_path):
    bench = _bench()
    out = tmp_path / "rows.jsonl"
    rows = bench.main(["--seqs", "3", "--max-len", "24", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                       "--dtype", "fp32", "--seconds", "0.5", "--device", "cpu", "--out", str(out)])
    assert [r["path"] for r in rows] == list(bench.PATHS)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["path"] for r in lines[:-1]] == list(bench.PATHS)
    assert lines[-1]["rule"]["auto"] == "sdpa-loop" and lines[-1]["rule"]["fastest"] in CPU_PATHS
    for r in rows:
        if r["path"] in CPU_PATHS:
            assert r["fwd_bwd_ms"] > 0 and max(r["error"].values()) <= 1e-5, r
        else:
            assert "CUDA" in r["skipped"] or "CPU" in r["skipped"], r


@pytest.mark.parametrize(("device", "dtype", "flash", "want"), [
    ("cpu", torch.bfloat16, True, "sdpa-loop"), ("cuda", torch.bfloat16, False, "flex"),
    ("cuda", torch.bfloat16, True, "flash-varlen"), ("cuda", torch.float32, True, "flex")])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_the_verdict_names_the_path_auto_runs(monkeypatch, device, dtype, flash, want, head_dim):
    """Flex's CUDA kernel takes head_dim >= 16: below it auto runs sdpa_varlen: PyTorch's flash varlen kernel (or
    the jagged SDPA path without it) in half precision on CUDA, else the loop."""
    if want == "flex" and head_dim < 16:
        torch_flash = "window_size" in sdpa_varlen._VARLEN_PARAMS  # PyTorch's own flash varlen entry point
        want = ("sdpa-flash" if torch_flash else "sdpa-nested") if dtype == torch.bfloat16 else "sdpa-loop"
    bench = _bench()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if flash else None) if name == "flash_attn" else real(name, *a))
    assert bench.auto_choice(torch.device(device), dtype, head_dim) == want
    reason = bench.unavailable("flex", torch.device("cuda"), torch.bfloat16, head_dim)
    assert (reason is None) == (head_dim >= 16)


def test_the_verdict_costs_setup_per_layer_and_compares_auto_with_the_fastest():
    rows = [{"path": "flex", "fwd_bwd_ms": 1.0, "setup_ms": 24.0}, {"path": "sdpa-nested", "fwd_bwd_ms": 1.5,
            "setup_ms": 0.0}, {"path": "padded-causal", "fwd_bwd_ms": 0.1, "setup_ms": 0.0},
            {"path": "flash-varlen", "skipped": "flash-attn is not installed"}]
    verdict = _bench().rule_verdict(rows, "flex", layers=24)  # flex: 1 + 24 / 24 = 2 ms a layer
    assert verdict["fastest"] == "sdpa-nested" and verdict["auto_over_fastest"] == pytest.approx(2 / 1.5, abs=1e-3)
    assert _bench().rule_verdict(rows, "flex", layers=240)["fastest"] == "flex"


@pytest.mark.parametrize("argv", [["--paths", "dense-mask,nope"], ["--layers", "0"],
                                  ["--heads", "3", "--kv-heads", "2"], ["--seconds", "0"], ["--seqs", "0"],
                                  ["--threads", "0"]])
def test_bench_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit):
        _bench().main(argv)
