"""Plan of a head call from a cost model of the device: token-chunk rows, vocabulary-slice columns, strategy.

A call is (N tokens, hidden size D, vocabulary V, input dtype, mode). The model adds up, in seconds:

* GEMMs, each `max(2mnk / R, operand bytes / B)` (compute- or operand-read-bound): forward 2NDV; the
  generic mode's backward recomputes the logits and forms dh, dW (6NDV; 8NDV in all), or, when the budget
  holds the forward's fp32 logits of all N rows until the backward (`HeadPlan.hold_logits`), forms dh and dW
  from them (6NDV in all); the fused-loss mode
  forms d(raw), dh, dW in the forward (6NDV in all); a coupled loss adds a statistics pass (8NDV).
* the epilogue's traffic, `bytes per logit element x rows x V / B` (`KernelCosts`: today 8 for the
  forward statistics, 22 for a backward pass with known statistics, 26 for a fused-loss chunk);
* accumulators: the fp32 [V, D] dW is read and written once per token chunk (`8 V D / B` per chunk) unless
  one GEMM forms each dW row; dh likewise once per vocabulary slice (`8 N D / B` per slice); zero-fills
  and the final fp32 -> input dtype conversions;
* the fused tl.dot strategy: its GEMMs at a fraction of R, and its backward's fp32 atomics at the device's
  atomic throughput;
* launches x the device's launch overhead.

R (GEMM FLOP/s of the input dtype), B (copy bandwidth, bytes read + written per second) and the launch
overhead come from a `DeviceModel`: presets for the H100 (calibrated from measured ceilings), H200 and A100
(public peak specs scaled by the fraction of its peak the H100 reached) and a rough CPU, chosen from the
device's name (`torch.cuda.get_device_name`) or forced with env `LUDIC_FAST_DEVICE_MODEL`.

`plan_head` returns the fastest `HeadPlan` whose transient memory (workspace chunks plus fp32 accumulators,
beyond inputs and returned outputs) fits `memory_budget` bytes; with no plan fitting, the one with the least
memory. Chunk rows and slice columns are multiples of the device's alignment (128 on GPUs: aligned GEMM
operands keep cuBLAS on its fast kernels), the last chunk aside. `chunk_elements` is the low-level override
(tokens x vocabulary columns of one chunk, the pre-model rule, no alignment). Predicted times are
predictions, not measurements.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from ludic_fast.ops.budget import (
    DEFAULT_CHUNK_ELEMENTS,
    align_down,
    default_chunk_elements,
    elements_rule,
    env_chunk_elements,
    grad_blocks,
    parse_memory_budget,
)

MODES = ("forward", "generic", "fused_loss", "coupled")
BACKEND_STRATEGIES = {"triton": ("workspace", "fused"), "torch": ("torch",)}
GiB = 2**30
#: GPU default budget: the mode's fp32 accumulators plus a workspace allowance of this fraction of the device's
#: memory, capped (1 GiB on an 80 GB card)
WORKSPACE_FRACTION = 1 / 64
WORKSPACE_CAP = GiB



# ----------------------------------------------------------------------------------------------- device
@dataclass(frozen=True)
class DeviceModel:
    """What the cost model knows of a device: GEMM FLOP/s per input dtype, copy bandwidth (bytes read +
    written per second), fp32 atomic-add throughput (bytes of fp32 updates per second), seconds per kernel
    launch, chunk/slice alignment in elements, total memory (bytes; None: no default budget)."""

    name: str
    bf16_flops: float
    fp16_flops: float
    fp32_flops: float
    bandwidth: float
    atomic_bandwidth: float
    launch_s: float
    align: int
    memory_bytes: int | None

    def gemm_flops(self, dtype: torch.dtype) -> float:
        """GEMM rate for operands of `dtype` (fp64: a tenth of fp32)."""
        if dtype == torch.bfloat16:
            return self.bf16_flops
        if dtype == torch.float16:
            return self.fp16_flops
        return self.fp32_flops if dtype == torch.float32 else self.fp32_flops / 10


# H100 SXM 80GB: cuBLAS bf16 GEMM 8192^3 measured at 765 TFLOP/s (77% of the 989 TFLOP/s dense spec), device
# copy 3.0 TB/s (90% of 3.35 TB/s); fp32 atomics ~0.8 TB/s fitted to the fused tl.dot backward at N = 512, 2048;
# fp32 GEMMs (no TF32) at 77% of the 67 TFLOP/s FMA spec.
_GEMM_EFF, _COPY_EFF = 765 / 989, 3.0 / 3.35
H100 = DeviceModel("h100", 765e12, 765e12, 67e12 * _GEMM_EFF, 3.0e12, 0.8e12, 5e-6, 128, 80 * 10**9)
# H200: the H100's compute with 4.8 TB/s HBM3e (same efficiencies assumed, not measured).
H200 = DeviceModel("h200", 765e12, 765e12, 67e12 * _GEMM_EFF, 4.8e12 * _COPY_EFF, 0.8e12 * 4.8 / 3.35, 5e-6, 128,
                   141 * 10**9)
# A100 SXM 80GB: 312 TFLOP/s bf16/fp16 dense, 19.5 TFLOP/s fp32, 2.04 TB/s (same efficiencies assumed).
A100 = DeviceModel("a100", 312e12 * _GEMM_EFF, 312e12 * _GEMM_EFF, 19.5e12 * _GEMM_EFF, 2.04e12 * _COPY_EFF,
                   0.8e12 * 2.04 / 3.35, 5e-6, 128, 80 * 10**9)
# CPU: a rough few-core machine; CPU chunking follows DEFAULT_CHUNK_ELEMENTS (no alignment), the model only
# ranks strategies and reports a time.
CPU = DeviceModel("cpu", 50e9, 20e9, 100e9, 20e9, 10e9, 10e-6, 1, None)
PRESETS = {m.name: m for m in (H100, H200, A100, CPU)}


def device_model(device: torch.device | str | DeviceModel | None = None) -> DeviceModel:
    """The `DeviceModel` of a device: a model passes through, a preset name ('h100', 'h200', 'a100', 'cpu')
    selects it, env `LUDIC_FAST_DEVICE_MODEL` (a preset name) overrides the choice for real devices, a CUDA
    device is matched by `torch.cuda.get_device_name` (unknown GPUs get the A100 preset) with its own total
    memory, anything else gets the CPU preset."""
    if isinstance(device, DeviceModel):
        return device
    if isinstance(device, str) and device.lower() in PRESETS:
        return PRESETS[device.lower()]
    dev = torch.device("cpu" if device is None else device)
    forced = os.environ.get("LUDIC_FAST_DEVICE_MODEL")
    if forced:
        if forced.lower() not in PRESETS:
            raise ValueError(f"LUDIC_FAST_DEVICE_MODEL must be one of {sorted(PRESETS)}, got {forced!r}")
        return PRESETS[forced.lower()]
    return _cuda_model(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" \
        else CPU


@functools.cache
def _cuda_model(index: int) -> DeviceModel:
    name = torch.cuda.get_device_name(index).upper()
    preset = next((PRESETS[k] for k in ("h200", "h100", "a100") if k.upper() in name), A100)
    return replace(preset, memory_bytes=int(torch.cuda.get_device_properties(index).total_memory))


def accumulator_bytes(mode: str, n: int, d: int, v: int, backend: str = "triton") -> int:
    """fp32 accumulators every plan of the mode holds: dh [N, D] (with gradients) and dW [V, D] (fused-loss
    modes; the torch backend's generic mode too, which accumulates both over its blocks)."""
    if mode == "forward":
        return 0
    return 4 * n * d if mode == "generic" and backend != "torch" else 4 * (n + v) * d


def workspace_allowance(device: torch.device | str | DeviceModel | None) -> int:
    """Transient bytes a chunked call may hold beyond its accumulators by default: on a GPU
    `min(WORKSPACE_CAP, WORKSPACE_FRACTION x memory)` (1 GiB on an 80 GB card), on the CPU 4 x 64 Mi fp32 logit
    elements (1 GiB)."""
    model = device_model(device)
    if model.memory_bytes is None:
        return 4 * 4 * DEFAULT_CHUNK_ELEMENTS
    return min(WORKSPACE_CAP, int(model.memory_bytes * WORKSPACE_FRACTION))


def default_memory_budget(model: DeviceModel, mode: str, n: int, d: int, v: int,
                          backend: str = "triton") -> int | None:
    """The default budget in bytes: on a GPU `accumulator_bytes` plus `min(WORKSPACE_CAP, WORKSPACE_FRACTION x
    memory)`; None on the CPU (there chunks hold DEFAULT_CHUNK_ELEMENTS logit elements, the
    CPU-tuned rule)."""
    if model.memory_bytes is None:
        return None
    return accumulator_bytes(mode, n, d, v, backend) + workspace_allowance(model)


# ------------------------------------------------------------------------------------------------ kernels
@dataclass(frozen=True)
class KernelCosts:
    """What the model assumes of the kernels; update it when they change. Defaults: this release's kernels.

    Bytes per element of the [rows, V] logits moved by the workspace strategy (bf16 inputs):
    `stats_bytes` forward statistics (GEMM writes fp32 z 4, row kernel reads it 4); `grad_bytes` a backward pass with
    known statistics (GEMM write 4, row kernel reads 4 and writes d(raw) in the operand dtype 2, gradient GEMMs read 2 +
    2); `held_grad_bytes` the same pass over logits the forward held (no GEMM write: the row kernel reads 4 and writes
    2, the GEMMs read 2 + 2); `loss_bytes` a fused-loss chunk (GEMM write 4, statistics read 4, gradient read 4 + write
    2, GEMM reads 2 + 2). `ws_bytes`: transient bytes per workspace element (the fp32 chunk; d(raw) lives in its
    memory). `lean_accumulators`: a gradient element with one contribution is written once by its GEMM in the input
    dtype, several accumulate in fp32 from a beta = 0 first GEMM (no zero-fill); False: fp32, zero-filled buffers
    throughout (`once_bytes` per dW element when one GEMM forms each dW row: fp32 output 4 + conversion 4 + 2).
    `fused_*`: the tl.dot strategy's GEMM rate as a fraction of cuBLAS's (forward measured at 22-25 ms against cuBLAS's
    13.1 ms at N=8192 D=4096 V=151936 on an H100) and, when `fused_bwd_atomics`, its backward's (BLOCK_M, BLOCK_N) tile,
    which sets its fp32 atomic traffic `ceil(V/BN) N D 4 + ceil(N/BM) V D 4` bytes (False: the fused strategy's backward
    runs the workspace backward's blocks, with the tl.dot gradient kernel recomputing the logits at `fused_fwd_fraction`
    of the cuBLAS rate and writing d(raw) from registers: `fused_grad_bytes` per logit element, d(raw) write 2 +
    gradient GEMM reads 2 + 2, and a block buffer of the input dtype).
    `torch_*`: the torch backend's bytes per logit element (forward, backward) and transient bytes per chunk
    element. `launches_*`: kernels per forward chunk, per backward block, per fused-loss chunk (the loss's
    O(n) autograd included), per torch-backend block. `fused_risk`: a factor on the tl.dot strategy's predicted
    time while its kernels are unmeasured (its backward and fused-loss paths, and any pass at D=896, never ran on
    a GPU): `auto` takes that strategy only where it is predicted faster even so (1.0 once measured).
    `deferred_dw`: a fused-loss plan of one token chunk whose d(raw) buffer is no larger than dW forms dW in the
    backward, one GEMM with the upstream gradient folded into h (`s.e` bytes per dW element, no scale pass);
    several fp32 contributions end in one pass that scales and casts (4 + `s.e`). `hold_logits`: one chunk of
    all N rows serves the call's next pass instead of a recompute: the workspace head op with autograd may
    keep its forward's for the backward (`HeadPlan.hold_logits`), a coupled loss in one chunk runs its
    gradient pass on its statistics pass's logits (6NDV). Host time: a call's host
    work (its host syncs, the Python glue and, in the fused-loss modes, the loss objective evaluated on the host
    between the kernels) of `host_loss_s` (fused-loss modes) or `host_head_s` (the head op with autograd)
    seconds, of which the part the device's own time t hides, `host_overlap` t, is not charged: the term is
    max(0, host - host_overlap t). Fitted to the H200 run (bench/results/gpu: measured minus predicted at
    N = 64, 512 and 2048, CISPO and the head op), the fused-loss one on the code before `deferred_dw`."""

    stats_bytes: float = 8.0
    grad_bytes: float = 14.0
    held_grad_bytes: float = 10.0
    loss_bytes: float = 18.0
    ws_bytes: float = 4.0
    lean_accumulators: bool = True
    once_bytes: float = 10.0
    fused_fwd_fraction: float = 13.1 / 23.5
    fused_bwd_fraction: float = 340 / 765
    fused_bwd_block: tuple[int, int] = (64, 128)
    fused_bwd_atomics: bool = False
    fused_grad_bytes: float = 6.0
    torch_fwd_bytes: float = 40.0
    torch_bwd_bytes: float = 60.0
    torch_chunk_bytes: float = 12.0
    launches_fwd_chunk: int = 4
    launches_bwd_block: int = 8
    launches_loss_chunk: int = 40
    launches_torch_block: int = 20
    fused_risk: float = 1.25
    deferred_dw: bool = True
    hold_logits: bool = True
    host_loss_s: float = 5.0e-3
    host_head_s: float = 2.0e-3
    host_overlap: float = 0.3


#: the kernels measured on an H100 (2026-11-23): fp32 d(raw) in place then a bf16 copy, zero-filled fp32
#: accumulators, the fused strategy's backward with fp32 atomics
MEASURED_KERNELS = KernelCosts(stats_bytes=8, grad_bytes=22, held_grad_bytes=18, loss_bytes=26, ws_bytes=6,
                               lean_accumulators=False, deferred_dw=False, hold_logits=False, host_loss_s=0.0,
                               host_head_s=0.0,
                               fused_fwd_fraction=340 / 765, fused_bwd_atomics=True, fused_risk=1.0)
KERNELS = KernelCosts()


# --------------------------------------------------------------------------------------------------- plan
def strategy_requested() -> str:
    """Env LUDIC_FAST_TRITON_STRATEGY (auto|fused|workspace; default auto): the triton strategy of a call that
    passes none, the head op's and the fused-loss mode's alike."""
    return os.environ.get("LUDIC_FAST_TRITON_STRATEGY", "auto")


@dataclass(frozen=True)
class HeadPlan:
    """The plan of one head call. `token_rows` x `vocab_cols`: one chunk of the forward (and of every pass of
    the fused-loss modes); `grad_rows` x `grad_cols`: one block of the generic backward. `predicted_s`: the
    model's time (a prediction), `terms`: its parts; `transient_bytes`: peak memory beyond inputs and outputs;
    `fits`: within `memory_budget` (None: the CPU element rule). `stage_rows` (fused-loss modes, triton
    backend): token rows whose d(raw) is staged for one dW GEMM, a multiple of `token_rows` (None: no
    staging, one dW GEMM per chunk). `hold_logits` (generic mode, workspace strategy): the forward's one chunk
    of all N rows of fp32 raw logits is kept until the backward, which writes d(raw) over it instead of
    recomputing the logits; its N V 4 bytes (`transient_bytes`) are held from the forward to the backward."""

    strategy: str
    token_rows: int
    vocab_cols: int
    grad_rows: int
    grad_cols: int
    predicted_s: float
    transient_bytes: int
    mode: str
    device: str
    memory_budget: int | None
    fits: bool = True
    stage_rows: int | None = None
    hold_logits: bool = False
    terms: tuple[tuple[str, float], ...] = field(default=(), compare=False)

    @property
    def blocks(self) -> tuple[int, int]:
        """(token rows, vocab columns) of one chunk, as `ChunkedHead` takes them."""
        return self.token_rows, self.vocab_cols


@dataclass(frozen=True)
class _Shape:
    n: int
    d: int
    v: int
    e: int  # input element size in bytes
    dtype: torch.dtype
    dev: DeviceModel
    k: KernelCosts


class _Cost:
    """Named time terms (seconds) and the transient-memory peak of one candidate."""

    def __init__(self, s: _Shape):
        self.s, self.terms, self.peak = s, {}, 0.0

    def add(self, name: str, seconds: float) -> None:
        self.terms[name] = self.terms.get(name, 0.0) + seconds

    def traffic(self, name: str, nbytes: float) -> None:
        self.add(name, nbytes / self.s.dev.bandwidth)

    def gemm(self, name: str, m: int, n: int, k: int, times: int = 1, rate_fraction: float = 1.0) -> None:
        """`times` GEMMs [m, k] x [k, n]: compute-bound or bound by reading their operands."""
        s = self.s
        flops = 2.0 * m * n * k / (s.dev.gemm_flops(s.dtype) * rate_fraction)
        reads = (m * k + k * n) * s.e / s.dev.bandwidth
        self.add(name, times * max(flops, reads))

    def launches(self, count: float) -> None:
        self.add("launch", count * self.s.dev.launch_s)

    def total(self) -> float:
        return sum(self.terms.values())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pieces(total: int, width: int) -> list[tuple[int, int]]:
    """[(count, size)] of `total` cut into pieces of `width` (the last one shorter)."""
    full, rest = divmod(total, width)
    return [(c, w) for c, w in ((full, width), (1 if rest else 0, rest)) if c]


def _balanced(total: int, width: int, align: int) -> int:
    """The same number of chunks as `width` gives, with the smallest aligned width (less memory)."""
    chunks = _cdiv(total, width)
    return min(total, _cdiv(_cdiv(total, chunks), align) * align) if chunks > 1 else total


# ---- cost of each strategy (adds to a _Cost; returns the plan's blocks)
def _workspace_forward(c: _Cost, rows: int) -> None:
    s = c.s
    for count, r in _pieces(s.n, rows):
        c.gemm("gemm", r, s.v, s.d, count)
    c.traffic("epilogue", s.k.stats_bytes * s.n * s.v)
    c.launches(s.k.launches_fwd_chunk * -(-s.n // rows))
    c.peak = max(c.peak, rows * s.v * 4)


def _accumulator(c: _Cost, name: str, count: int, elems: int, scaled: bool, once_fp32_out: bool = False,
                 deferred: bool = False) -> bool:
    """Traffic of a gradient (dh or dW, `elems` elements) that gets `count` contributions, plus the fused loss's
    backward scale (`scaled`; `deferred`: folded into the one GEMM that writes the gradient in the backward);
    returns whether it needs an fp32 buffer of its own."""
    s, k = c.s, c.s.k
    if k.lean_accumulators and count == 1:  # written once in the input dtype (scaled in place unless deferred)
        c.traffic(name, (s.e + (2 * s.e if scaled and not deferred else 0)) * elems)
        return False
    if once_fp32_out and count == 1:  # fp32 GEMM output converted to the input dtype
        c.traffic(name, k.once_bytes * elems)
        return False
    if k.lean_accumulators:  # beta = 0 first write; the scale and the cast in one pass (in place for fp32)
        first, last = 4, (4 + s.e if s.e < 4 else 8 if scaled else 0)
    else:  # zero-fill + read-modify-write; an in-place scale, then the cast
        first, last = 12, (8 if scaled else 0) + 4 + s.e
    c.traffic(name, (first + (count - 1) * 8 + last) * elems)
    return True


def _workspace_backward(c: _Cost, rows: int, cols: int, tl_dot: bool = False, held: bool = False) -> None:
    """The backward's blocks; `tl_dot`: d(raw) from the fused strategy's tl.dot gradient kernel; `held`: one
    block, over the logits the forward held (no logits GEMM)."""
    s, k = c.s, c.s.k
    row_chunks, slices = _cdiv(s.n, rows), _cdiv(s.v, cols)
    for rc, r in _pieces(s.n, rows):
        for cc, w in _pieces(s.v, cols):
            if not held:
                c.gemm("gemm", r, w, s.d, rc * cc, rate_fraction=k.fused_fwd_fraction if tl_dot else 1.0)  # logits
            c.gemm("gemm", r, s.d, w, rc * cc)  # dh
            c.gemm("gemm", w, s.d, r, rc * cc)  # dW
    per_element = k.fused_grad_bytes if tl_dot else k.held_grad_bytes if held else k.grad_bytes
    c.traffic("epilogue", per_element * s.n * s.v)
    mem = rows * cols * (s.e if tl_dot else k.ws_bytes)
    mem += 4 * s.n * s.d if _accumulator(c, "dh", slices, s.n * s.d, False) else 0
    mem += 4 * s.v * s.d if _accumulator(c, "dW", row_chunks, s.v * s.d, False, once_fp32_out=True) else 0
    if row_chunks == 1 and not k.lean_accumulators:
        mem += cols * s.d * 4  # the slice's fp32 GEMM output before its conversion
    c.launches(k.launches_bwd_block * row_chunks * slices)
    c.peak = max(c.peak, mem)


def _fused_loss_chunks(c: _Cost, rows: int, coupled: bool, stage: int | None, tl_dot: bool = False) -> None:
    """Token chunks of `rows` whole vocabulary rows; with `stage` > rows, the d(raw) of consecutive chunks is
    staged (input dtype) in a [stage, V] buffer and each group of `stage` rows takes one dW GEMM. `tl_dot`
    (the fused strategy): statistics by the tl.dot forward and d(raw) by the tl.dot gradient kernel, both at
    `fused_fwd_fraction` of the GEMM rate (8NDV in all, coupled or not), no fp32 workspace: the chunk's
    d(raw) buffer in the input dtype is all its memory."""
    s, k = c.s, c.s.k
    chunks = _cdiv(s.n, rows)
    group = rows if stage is None else stage
    if tl_dot:
        for count, r in _pieces(s.n, rows):
            c.gemm("gemm", r, s.v, s.d, 2 * count, rate_fraction=k.fused_fwd_fraction)  # statistics, recompute
        c.traffic("epilogue", k.fused_grad_bytes * s.n * s.v)
        c.launches(2 * chunks)  # the forward's merge, the gradient kernel
    else:
        if coupled and (chunks > 1 or not k.hold_logits):  # one chunk: its statistics pass serves the second
            _workspace_forward(c, rows)
        for count, r in _pieces(s.n, rows):
            c.gemm("gemm", r, s.v, s.d, count)
        c.traffic("epilogue", k.loss_bytes * s.n * s.v)
    for count, r in _pieces(s.n, rows):
        c.gemm("gemm", r, s.d, s.v, count)
    for count, g in _pieces(s.n, group):
        c.gemm("gemm", s.v, s.d, g, count)
    mem = rows * s.v * (s.e if tl_dot else k.ws_bytes) + (group * s.v * s.e if group > rows else 0)
    # one chunk whose d(raw) buffer is no larger than dW: dW = d(raw)^T (g h) in the backward (fused_loss.py)
    deferred = k.deferred_dw and chunks == 1 and group <= rows and mem <= s.v * s.d * s.e
    mem += 4 * s.n * s.d if _accumulator(c, "dh", 1, s.n * s.d, True) else 0
    mem += 4 * s.v * s.d if _accumulator(c, "dW", _cdiv(s.n, group), s.v * s.d, True, deferred=deferred) else 0
    c.launches(k.launches_loss_chunk * chunks)
    c.peak = max(c.peak, mem)


def _fused_dot(c: _Cost) -> None:
    """The tl.dot forward (statistics of whole rows, no logits workspace)."""
    s, k = c.s, c.s.k
    c.gemm("gemm", s.n, s.v, s.d, rate_fraction=k.fused_fwd_fraction)
    c.launches(2)
    c.peak = max(c.peak, 16 * s.n * 64)


def _fused_dot_backward(c: _Cost) -> None:
    """The tl.dot backward: recomputed tiles, dh and dW by fp32 atomics."""
    s, k = c.s, c.s.k
    bm, bn = k.fused_bwd_block
    flops = 4.0 * s.n * s.d * s.v / (s.dev.gemm_flops(s.dtype) * k.fused_bwd_fraction)
    c.add("gemm", flops)
    atomics = (-(-s.v // bn) * s.n * s.d + -(-s.n // bm) * s.v * s.d) * 4
    c.add("atomics", atomics / s.dev.atomic_bandwidth)
    c.traffic("dh", (8 + s.e) * s.n * s.d)  # zero-fill, conversion
    c.traffic("dW", (8 + s.e) * s.v * s.d)
    c.launches(6)
    c.peak = max(c.peak, 4 * (s.n + s.v) * s.d)


def _torch_blocks(c: _Cost, rows: int, cols: int, logit_passes: int, backward: bool) -> None:
    """The torch backend (and the sliced-vocabulary fused loss): `logit_passes` logits GEMMs per block, then
    the gradient GEMMs."""
    s, k = c.s, c.s.k
    blocks = _cdiv(s.n, rows) * _cdiv(s.v, cols)
    for rc, r in _pieces(s.n, rows):
        for cc, w in _pieces(s.v, cols):
            c.gemm("gemm", r, w, s.d, rc * cc * logit_passes)
            if backward:
                c.gemm("gemm", r, s.d, w, rc * cc)
                c.gemm("gemm", w, s.d, r, rc * cc)
    c.traffic("epilogue", (logit_passes * k.torch_fwd_bytes + backward * k.torch_bwd_bytes) * s.n * s.v)
    c.launches(k.launches_torch_block * blocks * (logit_passes + backward))
    c.peak = rows * cols * k.torch_chunk_bytes
    if backward:
        c.traffic("dh", (4 + 8 * _cdiv(s.v, cols) + 4 + s.e) * s.n * s.d)
        c.traffic("dW", (4 + 8 * _cdiv(s.n, rows) + 4 + s.e) * s.v * s.d)
        c.peak += 4 * (s.n + s.v) * s.d


class _Candidate(NamedTuple):
    """One candidate plan of a strategy: forward chunks of `rows` x `cols`, backward blocks of `grows` x
    `gcols`, the fused-loss dW staging rows, whether the forward's logits are held for the backward."""

    rows: int
    cols: int
    grows: int
    gcols: int
    stage: int | None = None
    hold: bool = False


def _price(s: _Shape, mode: str, strategy: str, cand: _Candidate) -> _Cost:
    """The cost of one candidate plan."""
    rows, cols, grows, gcols, stage, hold = cand
    c = _Cost(s)
    fused_modes = mode in ("fused_loss", "coupled")
    if strategy == "torch" or cols < s.v:  # the torch backend, or the sliced-vocabulary fused loss
        one_chunk = s.k.hold_logits and rows >= s.n and cols == s.v  # a coupled loss's passes share it
        passes = {"forward": 1, "generic": 2, "coupled": 1 if one_chunk else 2}.get(mode, 1 if cols == s.v else 2)
        _torch_blocks(c, rows, cols, passes, mode != "forward")
    elif fused_modes:
        _fused_loss_chunks(c, rows, mode == "coupled", stage, tl_dot=strategy == "fused")
    elif strategy == "fused":
        _fused_dot(c)
        if mode == "generic" and s.k.fused_bwd_atomics:
            _fused_dot_backward(c)
        elif mode == "generic":
            _workspace_backward(c, grows, gcols, tl_dot=True)
    else:
        _workspace_forward(c, rows)
        if mode == "generic":
            _workspace_backward(c, grows, gcols, held=hold)
    if strategy == "fused" and s.k.fused_risk != 1.0:
        c.add("unmeasured", (s.k.fused_risk - 1.0) * c.total())
    host = s.k.host_loss_s if fused_modes else s.k.host_head_s if mode == "generic" else 0.0
    exposed = host - s.k.host_overlap * c.total()
    if exposed > 0:
        c.add("host", exposed)
    return c


def _row_options(n: int, limit: int, align: int) -> list[int]:
    """Aligned token-chunk rows of at most `limit` rows: the largest (balanced) and a few smaller ones."""
    top = align_down(min(limit, n), align, n)
    out = set()
    while top > 0 and len(out) < 6:
        out.add(_balanced(n, top, align))
        top = align_down(top // 2, align, n) if top > align else 0
    return sorted(out, reverse=True)


def _stage_rows(n: int, d: int, v: int, rows: int, e: int, budget: int, k: KernelCosts) -> int:
    """The largest dW staging group (a multiple of `rows`, balanced) that fits the budget beside a workspace
    of `rows` rows: all n rows (no fp32 dW) if possible, else groups sharing an fp32 dW."""
    spare = budget - rows * v * k.ws_bytes
    if n * v * e <= spare:
        return n
    most = (spare - 4 * v * d) // (v * e) // rows * rows
    if most <= rows:
        return rows
    return min(n, _cdiv(_cdiv(n, _cdiv(n, most)), rows) * rows)


def _candidates(s: _Shape, mode: str, strategy: str, budget: int | None,
                chunk_elements: int | None) -> list[_Candidate]:
    """The candidates of one strategy (not all of them fit the budget)."""
    n, d, v, k, align = s.n, s.d, s.v, s.k, s.dev.align
    fused_modes = mode in ("fused_loss", "coupled")
    held = k.hold_logits and strategy == "workspace" and mode == "generic"  # may hold the forward's logits
    if strategy == "fused" and (mode == "forward" or k.fused_bwd_atomics):
        return [_Candidate(n, v, n, v)]
    if chunk_elements is not None:  # the element rule: an override, or the CPU default
        elements = chunk_elements
        rows, cols = elements_rule(n, v, elements)
        if strategy != "torch" and not fused_modes:  # whole rows forward, sliced backward
            if held and n * v <= elements:  # one chunk of all rows: held for the backward
                return [_Candidate(n, v, n, v, hold=True)]
            fwd_rows = n if strategy == "fused" else max(1, min(n, elements // v))
            return [_Candidate(fwd_rows, v, *grad_blocks(n, v, elements))]
        return [_Candidate(rows, cols, rows, cols)]
    fixed = 4 * (n + v) * d if mode != "forward" else 0  # fp32 dh and dW accumulators (torch backend)
    if strategy == "torch":
        rows, cols = elements_rule(n, v, max(1, int((budget - fixed) // k.torch_chunk_bytes)), align)
        return [_Candidate(rows, cols, rows, cols)]
    if fused_modes:
        per_row = v * (s.e if strategy == "fused" else k.ws_bytes)  # the chunk's workspace or d(raw) buffer
        fixed = accumulator_bytes(mode, n, d, v) if not k.lean_accumulators else 0
        if k.lean_accumulators and n * per_row > budget:  # several chunks: dW accumulates in fp32
            fixed = 4 * v * d
        rows_opts = _row_options(n, int((budget - fixed) // per_row), align)
        out = [_Candidate(r, v, r, v) for r in rows_opts]
        if k.lean_accumulators and strategy == "workspace":  # rows of a workspace beside a dW staging buffer
            stage_opts = _row_options(n, int(budget // (v * k.ws_bytes)), align)
            out += [_Candidate(r, v, r, v, g) for r in stage_opts if (g := _stage_rows(n, d, v, r, s.e, budget, k)) > r]
        if not out:  # not even `align` whole rows: vocabulary slices (the torch chunk code), or the least memory
            rows, cols = elements_rule(n, v, max(1, int((budget - fixed) // k.torch_chunk_bytes)), align)
            out = [_Candidate(rows, cols, rows, cols), _Candidate(min(n, align), v, min(n, align), v)]
        return out
    fwd_rows = n if strategy == "fused" else (_row_options(n, budget // (4 * v), align) or [min(n, align)])[0]
    if mode == "forward":
        return [_Candidate(fwd_rows, v, fwd_rows, v)]
    out = [_Candidate(n, v, n, v, hold=True)] if held else []
    for grows in [n, *_row_options(n, n // 2, align)]:
        multi = grows < n
        spare = budget - 4 * n * d - (4 * v * d if multi else 0)  # dh fp32 (several slices), dW fp32 (chunks)
        extra = 4 * d if not (multi or k.lean_accumulators) else 0  # a slice's fp32 dW GEMM output
        gcols = align_down(int(spare // (grows * k.ws_bytes + extra)), align, v)
        if k.lean_accumulators and grows * v * k.ws_bytes + (4 * v * d if multi else 0) <= budget:
            gcols = v  # one slice spans the vocabulary: dh needs no fp32 buffer
        if gcols > 0:
            out.append(_Candidate(fwd_rows, v, grows, gcols))
    return out + [_Candidate(fwd_rows, v, min(n, align), min(v, align))]  # the smallest block, fitting or not


def plan_head(
    n: int,
    d: int,
    v: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    mode: str = "generic",
    device: torch.device | str | DeviceModel | None = None,
    backend: str = "triton",
    memory_budget: int | str | None = None,
    chunk_elements: int | None = None,
    strategy: str | None = None,
    kernels: KernelCosts | None = None,
) -> HeadPlan:
    """The plan of a head call of `n` tokens, hidden size `d`, vocabulary `v`, inputs of `dtype`.

    `mode`: 'forward' (no gradient), 'generic' (autograd: forward, then a backward that recomputes the
    logits; 8NDV), 'fused_loss' (token-local loss, gradients formed in the forward; 6NDV), 'coupled'
    (sequence-coupled loss: a statistics pass, then the fused-loss pass; 8NDV). `backend` 'triton'
    (strategies 'workspace', 'fused') or 'torch'. `memory_budget`: bytes (int or '4GiB'). `chunk_elements`:
    the low-level override (logit elements per chunk, no alignment). Neither given: on the CPU the element rule
    of $LUDIC_FAST_CHUNK_ELEMENTS or 64 Mi elements; on a GPU the device default (`default_memory_budget`), or
    with $LUDIC_FAST_CHUNK_ELEMENTS set the accumulators plus 4 bytes per element of it (aligned plans).
    `strategy`: force one ('auto'/None: the fastest predicted)."""
    for name, x in (("n", n), ("d", d), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in BACKEND_STRATEGIES:
        raise ValueError(f"backend must be one of {tuple(BACKEND_STRATEGIES)}, got {backend!r}")
    if chunk_elements is not None and (isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int)
                                       or chunk_elements < 1):
        raise ValueError(f"chunk_elements must be an int >= 1, got {chunk_elements!r}")
    model = device_model(device)
    budget = parse_memory_budget(memory_budget)
    if budget is None and chunk_elements is None:  # the env override, else the device default
        env = env_chunk_elements()
        if model.memory_bytes is None:  # the CPU: the element rule
            chunk_elements = default_chunk_elements()
        elif env is not None:  # a GPU: the override as a workspace allowance (fp32 elements), aligned plans
            budget = accumulator_bytes(mode, max(n, 1), max(d, 1), max(v, 1), backend) + 4 * env
        else:
            budget = default_memory_budget(model, mode, max(n, 1), max(d, 1), max(v, 1), backend)
    allowed = BACKEND_STRATEGIES[backend]
    if strategy not in (None, "auto", *allowed):
        raise ValueError(f"strategy must be one of {('auto', *allowed)} for backend={backend!r}, got {strategy!r}")
    if strategy not in (None, "auto"):
        allowed = (strategy,)
    kernels = kernels or KERNELS
    if mode in ("fused_loss", "coupled") and kernels.fused_bwd_atomics:  # no tl.dot fused-loss path then
        allowed = tuple(a for a in allowed if a != "fused") or ("workspace",)
    return _plan(max(n, 1), max(d, 1), max(v, 1), dtype, mode, model, budget, chunk_elements, allowed, kernels)


@functools.lru_cache(maxsize=4096)
def _plan(n, d, v, dtype, mode, model, budget, chunk_elements, allowed, kernels) -> HeadPlan:
    s = _Shape(n, d, v, torch.empty((), dtype=dtype).element_size(), dtype, model, kernels)
    best = None
    for strategy in allowed:
        for cand in _candidates(s, mode, strategy, budget, chunk_elements):
            c = _price(s, mode, strategy, cand)
            fits = budget is None or c.peak <= budget
            key = (not fits, c.total() if fits else c.peak)
            if best is None or key < best[0]:
                best = (key, strategy, cand, c, fits)
    _, strategy, cand, c, fits = best
    return HeadPlan(strategy, cand.rows, cand.cols, cand.grows, cand.gcols, c.total(), int(math.ceil(c.peak)), mode,
                    model.name, budget, fits, cand.stage, cand.hold, tuple(sorted(c.terms.items())))


__all__ = [
    "plan_head", "HeadPlan", "DeviceModel", "KernelCosts", "KERNELS", "PRESETS", "device_model",
    "default_memory_budget", "accumulator_bytes", "workspace_allowance", "MEASURED_KERNELS",
]
