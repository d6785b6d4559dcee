"""Packed (varlen) attention paths side by side: one decoder layer's causal attention over S sequences, forward
and backward, each path timed and checked against a float64 reference, so that the packed path's kernel rule
(`ludic_fast.integrations.packing.auto_attention`: flash-attn varlen, else flex attention, else per-sequence SDPA)
rests on measured crossovers.

Paths (q `[1, heads, total, d]`, k / v `[1, kv_heads, total, d]`, sequences at `cu_seqlens`):

  padded-causal  the sequences padded to the longest, SDPA is_causal (right padding makes causal exact for the
                 real rows): the padded batch's attention without a padding mask, the fastest padded case
  padded-mask    the same with transformers' padded mask (causal and key not padding): SDPA gets a mask
  dense-mask     the packed `mask` path: one row, SDPA with the [total, total] block-diagonal causal mask
                 (under a mask kv heads are repeated, as transformers' sdpa does: enable_gqa would leave the
                 fused kernels on CUDA)
  sdpa-loop      `sdpa_varlen._loop`: one causal SDPA call per sequence (the CPU's and fp32's sdpa_varlen)
  sdpa-nested    `sdpa_varlen._nested`: one SDPA call over nested jagged tensors (CUDA, half precision)
  sdpa-flash     `sdpa_varlen._flash_varlen`: one call of PyTorch's flash varlen kernel (torch.nn.attention.varlen,
                 CUDA, half precision): sdpa_varlen's path there
  flex           transformers' flex_attention_forward (compiled flex) with `packing._block_mask` (no CPU backward)
  flex-torch-mask  the same with torch's create_block_mask of the same rule (evaluated at all total² pairs): the
                 setup the tile-built BlockMask replaces (its setup is timed on the CPU too)
  flash-varlen   flash_attn.flash_attn_varlen_func (when flash-attn is installed; CUDA, half precision)

The last line (and the jsonl's last object, `{"rule": ...}`) is the rule's verdict: the path
`packing.auto_attention` runs an sdpa model on for this device and dtype, the fastest library path measured
(cost a layer: fwd+bwd + setup / --layers), and their ratio; a ratio above 1 says the rule's order is wrong at
this shape.

"setup" is the per-micro-batch work shared by every layer (masks, block masks, padding index), timed apart;
"fwd+bwd" is one layer's attention forward and backward. CUDA: CUDA events, the median after warm-up (flex's
compile is in its warm-up); CPU: perf_counter. Each path's error: max |out - ref| / max |ref| for the output
and for dq, dk, dv against float64 attention of each sequence alone.

    python bench/packed_attention.py                          # GPU default: the Qwen2.5-0.5B shape, <= 30 s
    python bench/packed_attention.py --seqs 8 --max-len 256 --heads 4 --kv-heads 2 --threads 1 --seconds 10  # CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.integrations import packing, sdpa_varlen

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PATHS = ("padded-causal", "padded-mask", "dense-mask", "sdpa-loop", "sdpa-nested", "sdpa-flash", "flex",
         "flex-torch-mask", "flash-varlen")


class Layer(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def reference_attention(q: Tensor, k: Tensor, v: Tensor, lengths: list[int]) -> Tensor:
    """float64 softmax(q k^T / sqrt(d) + causal) v of each sequence alone, kv heads repeated -> [total, heads, d]."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (x[0].double() for x in (q, k, v))
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    outs = []
    for qs, ks, vs in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1)):
        n = qs.shape[1]
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


def _padded(padding_mask: bool) -> Callable:
    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        longest = max(lengths)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        cols = torch.cat([torch.arange(n) for n in lengths])
        state = {"rows": rows.to(device), "cols": cols.to(device), "shape": (len(lengths), longest)}
        if padding_mask:
            real = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
            causal = torch.ones(longest, longest, dtype=torch.bool).tril()
            state["mask"] = (causal[None] & real[:, None, :])[:, None].to(device)
        return state

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        rows, cols, (s, longest) = state["rows"], state["cols"], state["shape"]

        def pad(x: Tensor) -> Tensor:
            out = x.new_zeros(s, longest, x.shape[1], x.shape[3])
            out[rows, cols] = x[0].transpose(0, 1)
            return out.transpose(1, 2)

        mask = state.get("mask")
        if mask is not None:  # as transformers' sdpa: kv heads repeated under a mask (SDPA's enable_gqa would
            k, v = _repeat(k, q), _repeat(v, q)  # leave the fused kernels on CUDA)
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=mask is None)
        return out.transpose(1, 2)[rows, cols]

    return setup, run


def _repeat(kv: Tensor, q: Tensor) -> Tensor:
    from transformers.integrations.sdpa_attention import repeat_kv

    return repeat_kv(kv, q.shape[1] // kv.shape[1])


def _dense_mask():
    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        cu_t = torch.tensor(cu, device=device)
        return {"mask": packing._dense_mask(packing.document_ids(cu_t, cu[-1]), None)}

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        out = F.scaled_dot_product_attention(q, _repeat(k, q), _repeat(v, q), attn_mask=state["mask"])
        return out[0].transpose(0, 1)

    return setup, run


def _sdpa_loop():
    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        return {"lengths": [b - a for a, b in zip(cu[:-1], cu[1:])]}

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        return sdpa_varlen._loop(q, k, v, state["lengths"], None, 0.0, None, {"enable_gqa": True})[0]

    return setup, run


def _sdpa_nested():
    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        return {"bounds": cu}

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        return sdpa_varlen._nested(q, _repeat(k, q), _repeat(v, q), state["bounds"], 0.0, None)[0]

    return setup, run


def _sdpa_flash():
    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        return {"split": sdpa_varlen._Split(cu)}

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        return sdpa_varlen._flash_varlen(q, k, v, state["split"], q.shape[1] // k.shape[1], None, None)[0]

    return setup, run


def _flex(layer: Layer, tiles: bool):
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.flex_attention import flex_attention_forward

    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        doc = packing.document_ids(torch.tensor(cu, device=device), cu[-1])
        if tiles:
            return {"block_mask": packing._block_mask(doc)}
        rule = lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)  # noqa: E731
        return {"block_mask": create_block_mask(rule, None, None, cu[-1], cu[-1], device=device)}

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        return flex_attention_forward(layer, q, k, v, state["block_mask"])[0][0]

    return setup, run


def _flash_varlen():
    from flash_attn import flash_attn_varlen_func

    def setup(cu: list[int], device: torch.device) -> dict[str, Any]:
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return {"cu": torch.tensor(cu, dtype=torch.int32, device=device), "longest": max(lengths)}

    def run(q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> Tensor:
        cu, n = state["cu"], state["longest"]
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))
        return flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)

    return setup, run


def unavailable(path: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why `path` cannot run fwd+bwd on `device` in `dtype` at `head_dim`, or None."""
    half = dtype in (torch.float16, torch.bfloat16)
    if path == "sdpa-nested" and not (device.type == "cuda" and half):
        return "jagged SDPA is causal only in the CUDA half-precision kernels"
    if path == "sdpa-flash" and not (device.type == "cuda" and half):
        return "PyTorch's flash varlen kernel: CUDA, half precision"
    if path == "sdpa-flash" and "window_size" not in sdpa_varlen._VARLEN_PARAMS:
        return "this torch has no torch.nn.attention.varlen.varlen_attn(window_size=...)"
    if path == "sdpa-flash" and head_dim not in sdpa_varlen.FLASH_HEAD_DIMS:
        return "PyTorch's flash kernel takes head dimensions 8, 16, ..., 256"
    if path.startswith("flex") and device.type != "cuda":
        return "flex attention has no backward on CPU"
    if path.startswith("flex") and head_dim < packing.FLEX_CUDA_MIN_HEAD_DIM:
        return f"flex attention's CUDA kernel needs head_dim >= {packing.FLEX_CUDA_MIN_HEAD_DIM}"
    if path == "flash-varlen" and not (device.type == "cuda" and half):
        return "flash-attn: CUDA, half precision"
    if path == "flash-varlen" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    return None


def make_path(path: str, layer: Layer) -> tuple[Callable, Callable]:
    """(setup(cu, device) -> state, run(q, k, v, state) -> out [total, heads, d]) of one path."""
    builders = {"padded-causal": lambda: _padded(False), "padded-mask": lambda: _padded(True),
                "dense-mask": _dense_mask, "sdpa-loop": _sdpa_loop, "sdpa-nested": _sdpa_nested,
                "sdpa-flash": _sdpa_flash,
                "flex": lambda: _flex(layer, True), "flex-torch-mask": lambda: _flex(layer, False),
                "flash-varlen": _flash_varlen}
    return builders[path]()


def inputs(lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
           seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(1, heads, total, head_dim), rand(1, kv_heads, total, head_dim), rand(1, kv_heads, total, head_dim)
    return q, k, v, rand(total, heads, head_dim)


def errors(run: Callable, state: dict[str, Any], q: Tensor, k: Tensor, v: Tensor, grad: Tensor,
           lengths: list[int]) -> dict[str, float]:
    """max |got - ref| / max |ref| of the output and dq, dk, dv against `reference_attention` in float64."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = run(*leaves, state)
    out.backward(grad)
    refs = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = reference_attention(*refs, lengths)
    ref.backward(grad.double())

    def rel(a: Tensor, b: Tensor) -> float:
        a, b = a.detach().double(), b.detach()
        return float((a - b).abs().max() / b.abs().max())

    return {"out": rel(out, ref), **{f"d{n}": rel(a.grad, b.grad) for n, a, b in zip("qkv", leaves, refs)}}


def timed(fn: Callable[[], Any], device: torch.device, seconds: float, warmup: int = 2) -> list[float]:
    """Milliseconds of each call of `fn` after `warmup` calls, until `seconds` pass (at least 3 calls)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < end and len(times) < 50):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(path: str, lengths: list[int], args: argparse.Namespace, device: torch.device,
            seconds: float) -> dict[str, Any]:
    """One path's row: setup and fwd+bwd medians (ms) and spreads, and its errors against float64."""
    dtype = DTYPES[args.dtype]
    row: dict[str, Any] = {"path": path, "device": device.type, "dtype": args.dtype, "seqs": len(lengths),
                           "total": sum(lengths), "longest": max(lengths)}
    reason = unavailable(path, device, dtype, args.head_dim)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    if reason is not None:
        if path.startswith("flex"):  # the BlockMask builds on any device
            setup, _ = make_path(path, Layer(args.heads, args.kv_heads))
            row["setup_ms"] = statistics.median(timed(lambda: setup(cu, device), device, seconds))
        return {**row, "skipped": reason}
    layer = Layer(args.heads, args.kv_heads)
    setup, run = make_path(path, layer)
    q, k, v, grad = inputs(lengths, args.heads, args.kv_heads, args.head_dim, dtype, device, args.seed)
    state = setup(cu, device)
    row["error"] = errors(run, state, q, k, v, grad, lengths)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def step() -> None:
        run(*leaves, state).backward(grad)

    setup_ms = timed(lambda: setup(cu, device), device, seconds / 4)
    step_ms = timed(step, device, seconds * 3 / 4)
    row.update(setup_ms=statistics.median(setup_ms), fwd_bwd_ms=statistics.median(step_ms),
               fwd_bwd_spread=[min(step_ms), max(step_ms)], calls=len(step_ms))
    return row


#: the library's exact packed paths and the attention implementation each runs under
LIBRARY_PATHS = {"flash-varlen": "flash_attention_2", "flex": "flex_attention", "sdpa-flash": sdpa_varlen.SDPA_VARLEN,
                 "sdpa-nested": sdpa_varlen.SDPA_VARLEN, "sdpa-loop": sdpa_varlen.SDPA_VARLEN, "dense-mask": "sdpa"}


class _SdpaModel(torch.nn.Module):
    """A stand-in sdpa model for `packing.auto_attention`: it records the implementation the rule sets."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation="sdpa", head_dim=head_dim)

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name


def auto_choice(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The bench path `packing.auto_attention` runs an sdpa model on (`device`, compute `dtype`, `head_dim`;
    no window)."""
    model = _SdpaModel(head_dim)
    half = dtype in (torch.float16, torch.bfloat16)
    impl = packing.auto_attention(model, device, half=half) or "sdpa"
    if impl == sdpa_varlen.SDPA_VARLEN:  # no allocation: a stand-in query
        query = types.SimpleNamespace(is_cuda=device.type == "cuda", device=device, dtype=dtype,
                                      shape=(1, 1, 1, head_dim))
        if sdpa_varlen.flash_varlen_applies(query, [1], 0.0):
            return "sdpa-flash"
        return "sdpa-nested" if sdpa_varlen.nested_applies(query, [1], None) else "sdpa-loop"
    return next(path for path, name in LIBRARY_PATHS.items() if name == impl)


def rule_verdict(rows: list[dict[str, Any]], auto: str, layers: int) -> dict[str, Any]:
    """auto's path against the fastest measured library path, each costing fwd+bwd + setup / `layers` a layer
    (the masks are built once per micro-batch and shared by the layers)."""
    cost = {r["path"]: r["fwd_bwd_ms"] + r["setup_ms"] / layers for r in rows
            if r["path"] in LIBRARY_PATHS and "fwd_bwd_ms" in r}
    if not cost:
        return {"auto": auto, "fastest": None}
    fastest = min(cost, key=cost.__getitem__)
    verdict = {"auto": auto, "fastest": fastest, "layer_ms": {k: round(v, 4) for k, v in cost.items()}}
    if auto in cost:
        verdict["auto_over_fastest"] = round(cost[auto] / cost[fastest], 3)
    return verdict


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| path | setup ms | fwd+bwd ms (min-max) | x sdpa-loop | err out / dq / dk / dv |",
             "|---|---|---|---|---|"]
    base = next((r["fwd_bwd_ms"] for r in rows if r["path"] == "sdpa-loop" and "fwd_bwd_ms" in r), None)
    for r in rows:
        if "skipped" in r:
            setup = f"{r['setup_ms']:.3f}" if "setup_ms" in r else "-"
            lines.append(f"| {r['path']} | {setup} | skipped: {r['skipped']} | - | - |")
            continue
        e = r["error"]
        ratio = f"{r['fwd_bwd_ms'] / base:.2f}" if base else "-"
        lo, hi = r["fwd_bwd_spread"]
        lines.append(f"| {r['path']} | {r['setup_ms']:.3f} | {r['fwd_bwd_ms']:.3f} ({lo:.3f}-{hi:.3f}) | {ratio} | "
                     f"{e['out']:.1e} / {e['dq']:.1e} / {e['dk']:.1e} / {e['dv']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024, help="sequence lengths drawn uniformly in [max/8, max]")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ", ".join(PATHS))
    p.add_argument("--seconds", type=float, default=30.0, help="total time budget, shared by the paths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    p.add_argument("--layers", type=int, default=24, help="decoder layers sharing one setup (the rule's cost)")
    p.add_argument("--out", type=Path, default=None, help="write the rows (and last, the rule's verdict) as jsonl")
    args = p.parse_args(argv)
    paths = [x for x in args.paths.split(",") if x]
    bad = [x for x in paths if x not in PATHS]
    if bad:
        p.error(f"--paths: unknown {bad}; choose from {list(PATHS)}")
    for name in ("heads", "kv_heads", "head_dim", "seqs", "max_len", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    if args.seconds <= 0:
        p.error("--seconds must be > 0")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(max(1, args.max_len // 8), args.max_len + 1, (args.seqs,), generator=g).tolist()
    rows, started = [], time.perf_counter()
    for i, path in enumerate(paths):
        left = args.seconds - (time.perf_counter() - started)
        rows.append(measure(path, lengths, args, device, max(left, 0.0) / (len(paths) - i) * 0.5))
        if args.out is not None:
            args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, heads {args.heads}/{args.kv_heads}, d {args.head_dim}, "
          f"{args.seqs} sequences, total {sum(lengths)}, longest {max(lengths)}, "
          f"{time.perf_counter() - started:.1f} s")
    print(table(rows))
    verdict = rule_verdict(rows, auto_choice(device, DTYPES[args.dtype], args.head_dim), args.layers)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps({"rule": verdict}) + "\n")
    ratio = verdict.get("auto_over_fastest")
    print(f"rule: auto runs {verdict['auto']}; fastest library path {verdict['fastest']} "
          f"(fwd+bwd + setup/{args.layers} a layer); auto / fastest = {ratio if ratio is not None else 'unmeasured'}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
