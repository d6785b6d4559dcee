"""The cost model and planner of the head (`ludic_fast.ops.plan`): hand-derived numbers, budget, alignment,
and the orderings measured on an H100 (2026-11-23, at commit 6cccb55, kernels of that commit)."""

import itertools

import pytest
import torch

from ludic_fast.ops import budget as B
from ludic_fast.ops import plan as P

ANCHOR, QWEN, LLAMA = (8192, 4096, 151936), (16384, 896, 151936), (32768, 4096, 128256)
MI = 2**20
#: the kernels measured on the H100 (the model's defaults may move on as the kernels get leaner)
MEASURED = P.MEASURED_KERNELS


def _plan(shape, **kw):
    kw.setdefault("device", "h100")
    kw.setdefault("kernels", MEASURED)
    return P.plan_head(*shape, **kw)


def _terms(plan):
    return dict(plan.terms)


def test_dw_traffic_overhead_is_340_over_n_on_the_h100_preset():
    """One extra token chunk costs 8 V D bytes of fp32 dW traffic; a chunk of n rows costs 6 n D V FLOPs of
    GEMMs: overhead 8 R / (6 B n) = 8 * 765e12 / (6 * 3.0e12 * n) = 340 / n (441-row chunks: 77%)."""
    d, v, n = 4096, 151936, 441
    one = _plan((14 * n, d, v), mode="fused_loss", chunk_elements=14 * n * v)
    many = _plan((14 * n, d, v), mode="fused_loss", chunk_elements=n * v)
    assert (one.token_rows, many.token_rows) == (14 * n, n)
    per_chunk_dw = (_terms(many)["dW"] - _terms(one)["dW"]) / 13
    per_chunk_gemm = _terms(many)["gemm"] / 14
    assert per_chunk_dw == pytest.approx(8 * v * d / 3.0e12, rel=1e-12)
    assert per_chunk_gemm == pytest.approx(6 * n * d * v / 765e12, rel=1e-12)
    assert per_chunk_dw / per_chunk_gemm == pytest.approx(340 / n, rel=1e-12)
    assert 340 / 441 == pytest.approx(0.771, abs=1e-3)  # the profile measured 24.1 ms over 28.9 ms: 83%


def test_fused_loss_gemm_floor_is_6ndv_and_coupled_adds_a_statistics_pass():
    n, d, v = 6144, 4096, 151936
    loss = _plan((n, d, v), mode="fused_loss", chunk_elements=n * v)
    coupled = _plan((n, d, v), mode="coupled", chunk_elements=n * v)
    generic = _plan((n, d, v), mode="generic", strategy="workspace", chunk_elements=n * v)
    held = _plan((n, d, v), mode="generic", strategy="workspace", chunk_elements=n * v, kernels=P.KERNELS)
    assert _terms(loss)["gemm"] == pytest.approx(6 * n * d * v / 765e12)
    assert _terms(coupled)["gemm"] == pytest.approx(8 * n * d * v / 765e12)
    assert (generic.hold_logits, held.hold_logits) == (False, True)
    assert _terms(generic)["gemm"] == pytest.approx(8 * n * d * v / 765e12)  # the backward recomputes the logits
    assert _terms(held)["gemm"] == pytest.approx(6 * n * d * v / 765e12)  # it forms dh and dW from the held ones
    assert _terms(loss)["epilogue"] == pytest.approx(26 * n * v / 3.0e12)


@pytest.mark.parametrize(
    "shape,measured",
    [  # CISPO fused-loss mode on the scored rows (3/4 of N); chunk elements -> measured ms
        ((6144, 4096, 151936), {64: 69.2, 256: 48.1, 1024: 42.3}),
        ((12288, 896, 151936), {64: 48.3, 256: 32.9, 1024: 29.8}),
        ((24576, 4096, 128256), {64: 205.4, 256: 148.2, 1024: 139.8}),
    ],
    ids=["anchor", "qwen0.5b", "llama8b"],
)
def test_fused_loss_predictions_track_the_h100_measurements(shape, measured):
    """Larger chunks are faster, as measured; and every prediction is within 10% of the measured time."""
    times = {mi: _plan(shape, mode="fused_loss", chunk_elements=mi * MI).predicted_s * 1e3 for mi in measured}
    assert times[64] > times[256] > times[1024]
    for mi, ms in measured.items():
        assert times[mi] == pytest.approx(ms, rel=0.10), (mi, times[mi], ms)


def test_head_op_predictions_track_the_h100_measurements():
    """Head op fwd+bwd with the 64 Mi-element chunk (workspace): 70.8, 47.3, 243.5 ms measured."""
    for shape, ms in ((ANCHOR, 70.8), (QWEN, 47.3), (LLAMA, 243.5)):
        plan = _plan(shape, mode="generic", strategy="workspace", chunk_elements=64 * MI)
        assert plan.predicted_s * 1e3 == pytest.approx(ms, rel=0.12)
    fwd = _plan(ANCHOR, mode="forward", strategy="workspace", chunk_elements=64 * MI)
    assert fwd.predicted_s * 1e3 == pytest.approx(18.3, rel=0.10)


@pytest.mark.parametrize("n,ws_ms,fused_ms", [(64, 4.5, 10.7), (512, 7.0, 43.7), (2048, 19.2, 166.7)])
def test_workspace_beats_the_fused_tl_dot_strategy_at_small_n(n, ws_ms, fused_ms):
    """Measured: the fused strategy (fp32 atomics on dW at every k step) is 2.4-9x slower than the workspace
    strategy at N = 64..2048; the model ranks them the same way and `auto` picks the workspace."""
    shape = (n, 4096, 151936)
    ws = _plan(shape, mode="generic", strategy="workspace", chunk_elements=64 * MI)
    fused = _plan(shape, mode="generic", strategy="fused", chunk_elements=64 * MI)
    assert fused.predicted_s > 1.5 * ws.predicted_s
    assert _plan(shape, mode="generic").strategy == "workspace"
    assert fused.predicted_s * 1e3 == pytest.approx(fused_ms, rel=0.3)
    assert ws.predicted_s * 1e3 == pytest.approx(ws_ms, rel=0.25)


def test_auto_never_picks_a_path_predicted_slower():
    for shape, mode, budget in itertools.product(
        [ANCHOR, QWEN, (64, 4096, 151936), (300, 40, 1021)], ["forward", "generic"], [None, 2**28, 2**31, 2**33]
    ):
        auto = _plan(shape, mode=mode, memory_budget=budget)
        for strategy in ("workspace", "fused"):
            forced = _plan(shape, mode=mode, memory_budget=budget, strategy=strategy)
            if forced.fits:
                assert auto.fits and auto.predicted_s <= forced.predicted_s


@pytest.mark.parametrize("mode", P.MODES)
@pytest.mark.parametrize("shape", [ANCHOR, QWEN, LLAMA, (64, 4096, 151936), (2048, 4096, 151936)])
def test_more_budget_never_predicts_slower_and_the_budget_is_respected(mode, shape):
    previous = None
    for gib in (0.25, 0.5, 1, 2, 3, 4, 6, 8, 16):
        budget = int(gib * P.GiB)
        plan = _plan(shape, mode=mode, memory_budget=budget)
        if plan.fits:
            assert plan.transient_bytes <= budget
            if previous is not None and previous.fits:
                assert plan.predicted_s <= previous.predicted_s * (1 + 1e-12)
        previous = plan


def test_a_budget_nothing_fits_gets_the_least_memory_plan():
    n, d, v = ANCHOR
    tiny = _plan(ANCHOR, mode="fused_loss", memory_budget=10**6)
    assert not tiny.fits
    assert tiny.transient_bytes >= 4 * (n + v) * d  # the fp32 dW and dh every fused-loss plan holds
    assert tiny.transient_bytes <= _plan(ANCHOR, mode="fused_loss", memory_budget=P.GiB // 2).transient_bytes


@pytest.mark.parametrize("mode", P.MODES)
def test_chunks_and_slices_are_multiples_of_128_on_gpus(mode):
    shapes = [ANCHOR, QWEN, LLAMA, (32704, 4096, 128256), (1000, 4096, 50257), (129, 512, 4099), (64, 64, 300)]
    for shape, gib in itertools.product(shapes, (0.1, 0.5, 1, 3, 20)):
        n, _, v = shape
        plan = _plan(shape, mode=mode, memory_budget=int(gib * P.GiB))
        for rows in (plan.token_rows, plan.grad_rows):
            assert rows == n or rows % 128 == 0, (shape, gib, plan)
        for cols in (plan.vocab_cols, plan.grad_cols):
            assert cols == v or cols % 128 == 0, (shape, gib, plan)


def test_sft_slices_at_llama_shape_are_aligned():
    """32704 rows x 64 Mi elements gave 2052-column slices (4104-byte rows: cuBLAS fell back to Ampere
    kernels); a byte budget gives 128-multiples."""
    assert B.grad_blocks(32704, 128256, 64 * MI) == (32704, 2048)  # the element override, aligned too
    plan = _plan((32704, 4096, 128256), mode="generic", memory_budget=P.GiB)
    assert plan.grad_cols % 128 == 0 and plan.fits


def test_cpu_default_is_the_64mi_element_rule():
    """On the CPU the chunking is unchanged: whole rows of a 64 Mi-element chunk (441 rows at V=151936), or
    16 tokens and a vocabulary slice when fewer than 16 rows fit."""
    assert P.default_memory_budget(P.CPU, "generic", 8192, 4096, 151936) is None
    for mode, backend in (("generic", "torch"), ("fused_loss", "torch"), ("fused_loss", "triton")):
        plan = P.plan_head(8192, 4096, 151936, mode=mode, device="cpu", backend=backend)
        assert plan.blocks == (441, 151936)
    assert B.chunk_plan(100, 1000, 3000) == (16, 187)
    assert B.chunk_plan(10, 1000, 10_000) == (10, 1000)  # all 10 rows fit: whole rows
    assert B.chunk_plan(8192, 151936, None) == (64 * MI // 151936, 151936)


def test_default_budget_on_gpus():
    """Accumulators of the mode + min(1 GiB, memory / 64)."""
    n, d, v = ANCHOR
    assert P.default_memory_budget(P.H100, "fused_loss", n, d, v) == 4 * (n + v) * d + P.GiB
    assert P.default_memory_budget(P.H100, "generic", n, d, v) == 4 * n * d + P.GiB
    # the torch backend's generic mode accumulates fp32 dh and dW over its blocks: both count as accumulators
    assert P.default_memory_budget(P.H100, "generic", n, d, v, backend="torch") == 4 * (n + v) * d + P.GiB
    small = P.replace(P.H100, memory_bytes=24 * 10**9)
    assert P.default_memory_budget(small, "forward", n, d, v) == 24 * 10**9 // 64
    plan = P.plan_head(*ANCHOR, mode="fused_loss", device="h100")
    assert plan.memory_budget == 4 * (n + v) * d + P.GiB and plan.fits


def test_device_model_selection(monkeypatch):
    assert P.device_model("h200") is P.H200 and P.device_model(P.A100) is P.A100
    assert P.device_model(torch.device("cpu")) is P.CPU
    monkeypatch.setenv("LUDIC_FAST_DEVICE_MODEL", "h100")
    assert P.device_model(torch.device("cpu")) is P.H100
    monkeypatch.setenv("LUDIC_FAST_DEVICE_MODEL", "tpu")
    with pytest.raises(ValueError, match="LUDIC_FAST_DEVICE_MODEL"):
        P.device_model(torch.device("cpu"))


@pytest.mark.parametrize("name,preset", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                         ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "a100")])
def test_cuda_devices_are_matched_by_name(monkeypatch, name, preset):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props)
    P._cuda_model.cache_clear()
    try:
        model = P.device_model(torch.device("cuda", 0))
    finally:
        P._cuda_model.cache_clear()
    assert model == P.replace(P.PRESETS[preset], memory_bytes=80 * 2**30)


def test_presets_scale_public_specs_by_the_h100_efficiency():
    assert P.H100.bf16_flops == 765e12 and P.H100.bandwidth == 3.0e12
    assert P.H200.bf16_flops == P.H100.bf16_flops and P.H200.bandwidth == pytest.approx(4.8e12 * 3.0 / 3.35)
    assert P.A100.bf16_flops == pytest.approx(312e12 * 765 / 989)
    assert P.H100.gemm_flops(torch.float32) < P.H100.gemm_flops(torch.bfloat16)


@pytest.mark.parametrize("text,value", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("3.5GB", 3_500_000_000),
                                        ("1e9", 10**9), (" 2 gib ", 2 * 2**30), (12345, 12345)])
def test_parse_memory_budget(text, value):
    assert B.parse_memory_budget(text) == value


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "-1GiB", 0, -3, "0"])
def test_bad_memory_budget_values(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        B.parse_memory_budget(bad)


@pytest.mark.parametrize("kw,match", [({"mode": "backward"}, "mode"), ({"backend": "cuda"}, "backend"),
                                      ({"strategy": "torch"}, "strategy"), ({"chunk_elements": 0}, "chunk_elements"),
                                      ({"memory_budget": "lots"}, "memory_budget")])
def test_plan_head_names_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        P.plan_head(8, 16, 32, device="h100", **kw)


def test_forced_strategy_and_the_torch_backend():
    assert _plan(ANCHOR, mode="generic", strategy="fused").strategy == "fused"
    torch_plan = _plan(ANCHOR, mode="generic", backend="torch", memory_budget=4 * P.GiB)
    assert torch_plan.strategy == "torch" and torch_plan.fits
    assert torch_plan.token_rows % 128 == 0 and torch_plan.vocab_cols == ANCHOR[2]


def test_lean_kernels_accumulator_traffic_and_memory():
    """This release's kernels: 18 bytes per logit element in a fused-loss chunk; dW with several chunks: the
    first written with beta = 0 (4 V D), each later chunk read + written (8 V D), the backward's scale and cast
    to bf16 in one pass (4 + 2); with one chunk whose fp32 workspace is larger than dW (6144 rows against
    D = 4096) dW is written once in bf16 (2) and scaled in place (4), and no fp32 [V, D] buffer is held."""
    n, d, v = 6144, 4096, 151936
    lean = P.KERNELS
    three = P.plan_head(n, d, v, mode="fused_loss", device="h100", chunk_elements=2048 * v, kernels=lean)
    one = P.plan_head(n, d, v, mode="fused_loss", device="h100", chunk_elements=n * v, kernels=lean)
    assert dict(three.terms)["dW"] == pytest.approx((4 + 2 * 8 + 6) * v * d / 3.0e12)
    assert dict(one.terms)["dW"] == pytest.approx((2 + 4) * v * d / 3.0e12)
    assert dict(one.terms)["epilogue"] == pytest.approx(18 * n * v / 3.0e12)
    assert one.transient_bytes == n * v * 4  # the fp32 workspace only (d(raw) lives in its memory)
    assert three.transient_bytes == 2048 * v * 4 + 4 * v * d  # + the fp32 dW
    generic = P.plan_head(8192, d, v, mode="generic", device="h100", memory_budget=P.GiB, kernels=lean)
    assert generic.strategy == "workspace" and generic.fits  # the fused forward is predicted slower
    assert P.plan_head(8192, d, v, mode="generic", device="h100", strategy="fused").predicted_s > generic.predicted_s


def test_dw_staging_when_one_fp32_dw_does_not_fit():
    """6144 x 151936 bf16 rows under 2 GiB: one chunk's fp32 workspace (3.48 GiB) does not fit, nor does a
    chunked plan's fp32 dW (2.32 GiB) — but staging all rows' bf16 d(raw) (1.74 GiB) beside a small workspace
    does, with dW written once in bf16 (2 bytes per element, scaled in place: 4)."""
    n, d, v = 6144, 4096, 151936
    plan = P.plan_head(n, d, v, mode="fused_loss", device="h100", memory_budget=2 * P.GiB)
    assert plan.fits and plan.stage_rows == n and plan.token_rows < n and plan.token_rows % 128 == 0
    assert plan.transient_bytes == plan.token_rows * v * 4 + n * v * 2
    assert dict(plan.terms)["dW"] == pytest.approx((2 + 4) * v * d / 3.0e12)
    assert P.plan_head(n, d, v, mode="fused_loss", device="h100", memory_budget=2 * P.GiB,
                       kernels=MEASURED).stage_rows is None  # the measured kernels could not stage


def test_fused_loss_tl_dot_strategy_terms_and_memory():
    """The fused (tl.dot) strategy in fused-loss mode: statistics and the recompute are two tl.dot passes at
    `fused_fwd_fraction` of the GEMM rate plus cuBLAS dh and dW (8NDV, coupled or not), 6 bytes per logit
    element (d(raw) written in bf16 2, read by both GEMMs 2 + 2), and a bf16 [rows, V] d(raw) buffer as its
    only chunk memory (half the workspace strategy's fp32 chunk)."""
    n, d, v = 6144, 896, 151936
    lean = P.KERNELS
    for mode in ("fused_loss", "coupled"):
        plan = P.plan_head(n, d, v, mode=mode, device="h100", chunk_elements=n * v, strategy="fused", kernels=lean)
        two_dots = 2 * 2 * n * d * v / (765e12 * lean.fused_fwd_fraction)
        assert plan.strategy == "fused"
        assert dict(plan.terms)["gemm"] == pytest.approx(two_dots + 4 * n * d * v / 765e12)
        assert dict(plan.terms)["epilogue"] == pytest.approx(6 * n * v / 3.0e12)
        assert plan.transient_bytes == n * v * 2
    workspace = P.plan_head(n, d, v, mode="fused_loss", device="h100", chunk_elements=n * v, strategy="workspace",
                            kernels=lean)
    assert workspace.transient_bytes == n * v * 4


def test_auto_weighs_both_strategies_in_fused_loss_mode():
    """Auto takes the predicted-faster strategy per budget: at D=4096 the cuBLAS workspace (the tl.dot GEMMs
    are slower and the GEMMs dominate); under a budget where the workspace must cut small chunks that each
    read-modify-write an fp32 dW, the tl.dot strategy's smaller buffer can win. The measured kernels (atomic
    tl.dot backward) had no fused-loss tl.dot path, so they never plan one."""
    for shape in ((6144, 4096, 151936), (12288, 896, 151936), (24576, 4096, 128256)):
        for budget in (None, P.GiB, 2 * P.GiB, 4 * P.GiB):
            kw = {"mode": "fused_loss", "device": "h100", "memory_budget": budget, "kernels": P.KERNELS}
            auto, ws, dot = (P.plan_head(*shape, strategy=s, **kw) for s in ("auto", "workspace", "fused"))
            fitting = [p for p in (ws, dot) if p.fits]
            if fitting:
                assert auto.fits and auto.predicted_s == min(p.predicted_s for p in fitting)
    assert P.plan_head(6144, 4096, 151936, mode="fused_loss", device="h100", kernels=P.KERNELS).strategy == "workspace"
    assert _plan((6144, 896, 151936), mode="fused_loss", strategy="fused").strategy == "workspace"


@pytest.mark.parametrize("shape", [ANCHOR, QWEN, LLAMA, (64, 4096, 151936), (512, 4096, 151936)])
def test_torch_backend_keeps_whole_vocabulary_rows_on_gpus(shape):
    """The torch backend's generic mode on a GPU at the default budget: chunks of whole vocabulary rows (a
    multiple of 128 rows, or all of them), fitting. Before its fp32 dW counted as an accumulator, the 1 GiB
    allowance minus dh and dW was negative and the plan fell to 128 x 128 blocks: 23 s predicted per call at the
    anchor, 78 s at the 8B shape."""
    n, d, v = shape
    plan = P.plan_head(n, d, v, mode="generic", device="h100", backend="torch")
    assert plan.fits and plan.vocab_cols == v
    assert plan.token_rows == n or plan.token_rows % 128 == 0
    assert plan.token_rows >= min(n, 512)
    assert plan.predicted_s < 1.0


def test_the_tl_dot_strategy_is_charged_its_unmeasured_risk():
    """This release's tl.dot strategy never ran on a GPU: its prediction carries `fused_risk` (a 25% term named
    'unmeasured'), so at D=896 and at N=64, where it was predicted 4-10% faster than the measured cuBLAS
    workspace, auto keeps the workspace; the measured kernels carry no such term."""
    for shape, mode in ((QWEN, "generic"), (QWEN, "forward"), ((64, 4096, 151936), "generic"),
                        ((2048, 896, 151936), "forward")):
        fused = P.plan_head(*shape, mode=mode, device="h100", strategy="fused")
        terms = dict(fused.terms)
        device_s = fused.predicted_s - terms["unmeasured"] - terms.get("host", 0.0)  # the host term: no risk
        assert terms["unmeasured"] == pytest.approx(0.25 * device_s)
        assert P.plan_head(*shape, mode=mode, device="h100").strategy == "workspace"
    assert "unmeasured" not in dict(_plan(QWEN, mode="generic", strategy="fused").terms)


def test_the_staging_case_plans_differ_on_the_cpu_and_cuda_presets():
    """The dW-staging case of tests/interpret/test_fused_loss_kernels.py (bf16, N=40, D=40, V=1021, 150000
    bytes, workspace strategy): the CPU preset (no alignment) takes 14-row chunks staging all 40 rows; on a GPU
    (128-aligned chunks) nothing fits and the least-memory plan is one 40-row chunk. That interpreter test pins
    the CPU preset (LUDIC_FAST_DEVICE_MODEL=cpu) so it asserts the same plan on CUDA."""
    kw = {"dtype": torch.bfloat16, "mode": "fused_loss", "memory_budget": 150_000, "strategy": "workspace"}
    cpu, gpu = (P.plan_head(40, 40, 1021, device=dev, **kw) for dev in ("cpu", "h100"))
    assert (cpu.token_rows, cpu.stage_rows, cpu.fits) == (14, 40, True)
    assert (gpu.token_rows, gpu.stage_rows, gpu.fits) == (40, None, False)


def test_the_chunk_env_override_keeps_gpu_plans_aligned(monkeypatch):
    """$LUDIC_FAST_CHUNK_ELEMENTS on a GPU is a workspace allowance (4 bytes per element beside the
    accumulators) for the aligned planner, no longer the CPU's element rule: at the 8B head's 32704 rows that
    rule cut 523-row chunks (and, in linear_cross_entropy, 2052-column slices that sent cuBLAS to its Ampere
    kernels). On the CPU it stays the element rule."""
    n, d, v = 32704, 4096, 128256
    monkeypatch.setenv("LUDIC_FAST_CHUNK_ELEMENTS", str(64 * MI))
    plan = P.plan_head(n, d, v, mode="fused_loss", device="h100")
    assert plan.memory_budget == 4 * (n + v) * d + 4 * 64 * MI and plan.fits
    assert plan.token_rows % 128 == 0 and plan.vocab_cols == v
    head = P.plan_head(n, d, v, mode="generic", device="h100")
    assert head.token_rows % 128 == 0 and head.grad_cols % 128 == 0 and head.memory_budget == 4 * n * d + 4 * 64 * MI
    assert P.plan_head(n, d, v, mode="fused_loss", device="cpu").blocks == (64 * MI // v, v)


def test_workspace_allowance():
    assert P.workspace_allowance("h100") == P.GiB and P.workspace_allowance("cpu") == P.GiB
    assert P.workspace_allowance(P.replace(P.H100, memory_bytes=24 * 10**9)) == 24 * 10**9 // 64


def test_one_chunk_fused_loss_dw_passes_and_the_host_term():
    """One-chunk fused-loss plans (bf16, D=4096, V=151936, H200 preset): with 48 rows (fp32 workspace 48 V 4
    bytes <= dW's V D 2) dW is formed by the backward's GEMM: k = 1 pass of V D 2 bytes at the H200's copy
    bandwidth (4.8 TB/s x 3.0/3.35); at 2176 rows (workspace larger than dW) k = 3: the GEMM's write, then the
    backward's in-place scale (read + write); 2048 rows is the boundary (2048 V 4 = V D 2). The host term is
    max(0, host_loss_s - 0.3 t) for the device terms' t (5 ms at most: N=48 pays nearly all of it, 2176 rows
    about 1 ms, the anchor's 6144 rows none), the head op's likewise with host_head_s = 2 ms; the measured
    kernels had none."""
    d, v = 4096, 151936
    bw = 4.8e12 * 3.0 / 3.35
    for n, passes in ((48, 1), (2048, 1), (2176, 3)):
        plan = P.plan_head(n, d, v, mode="fused_loss", device="h200")
        terms = _terms(plan)
        assert (plan.token_rows, plan.stage_rows) == (n, None)
        assert terms["dW"] == pytest.approx(passes * v * d * 2 / bw)
        device_s = sum(t for name, t in terms.items() if name != "host")
        assert terms.get("host", 0.0) == pytest.approx(max(0.0, 5e-3 - 0.3 * device_s), abs=1e-15)
        assert plan.predicted_s == pytest.approx(device_s + terms.get("host", 0.0))
    hosts = [_terms(P.plan_head(n, d, v, mode="fused_loss", device="h200")).get("host", 0.0) for n in (48, 2176, 6144)]
    assert 4e-3 < hosts[0] < 5e-3 and 0 < hosts[1] < 1.5e-3 and hosts[2] == 0.0
    head = P.plan_head(64, d, v, mode="generic", device="h200")
    assert _terms(head)["host"] == pytest.approx(2e-3 - 0.3 * (head.predicted_s - _terms(head)["host"]))
    assert "host" not in _terms(P.plan_head(64, d, v, mode="forward", device="h200"))
    assert "host" not in _terms(P.plan_head(48, d, v, mode="fused_loss", device="h200", kernels=MEASURED))


def test_the_head_op_holds_its_forward_logits_when_the_budget_allows():
    """This release's kernels: a workspace head op with autograd whose one forward chunk of all N rows (N V 4
    bytes of fp32 logits) fits the budget keeps it for the backward: dh and dW are its only backward GEMMs
    (6NDV in all, against 8NDV recomputing), its backward epilogue moves 10 bytes per logit element (row
    kernel reads 4, writes d(raw) 2; GEMMs read 2 + 2) instead of 14 (+ the GEMM's fp32 write). At the anchor
    shape that needs 4.6 GiB: the H200's default budget (1 GiB + dh) recomputes, 6 GiB holds."""
    n, d, v = ANCHOR
    kw = {"mode": "generic", "device": "h200", "kernels": P.KERNELS}
    default = P.plan_head(n, d, v, **kw)
    held = P.plan_head(n, d, v, memory_budget="6GiB", **kw)
    assert not default.hold_logits and default.fits
    assert held.hold_logits and held.strategy == "workspace" and held.fits
    assert (held.token_rows, held.vocab_cols, held.grad_rows, held.grad_cols) == (n, v, n, v)
    assert held.transient_bytes == n * v * 4  # dh and dW are written once in bf16: no fp32 accumulator
    assert dict(held.terms)["gemm"] == pytest.approx(6 * n * d * v / 765e12)
    assert dict(held.terms)["epilogue"] == pytest.approx((8 + 10) * n * v / (4.8e12 * 3.0 / 3.35))
    assert held.predicted_s < default.predicted_s
    # 1,024 rows (0.58 GiB of logits) fit the default budget
    assert P.plan_head(1024, d, v, **kw).hold_logits
    # 4 N V bytes (the bench's ours-generic-held) hold them; one byte less does not
    assert P.plan_head(n, d, v, memory_budget=n * v * 4, **kw).hold_logits
    assert not P.plan_head(n, d, v, memory_budget=n * v * 4 - 1, **kw).hold_logits


@pytest.mark.parametrize("kw", [{"mode": "forward"}, {"mode": "fused_loss"}, {"mode": "coupled"},
                                {"mode": "generic", "strategy": "fused"}, {"mode": "generic", "backend": "torch"},
                                {"mode": "generic", "kernels": P.MEASURED_KERNELS}],
                         ids=["forward", "fused_loss", "coupled", "fused-strategy", "torch-backend", "h100-kernels"])
def test_only_the_workspace_head_op_holds_logits(kw):
    kw = {"device": "h200", "memory_budget": "64GiB", "kernels": P.KERNELS, **kw}
    assert not P.plan_head(*ANCHOR, **kw).hold_logits


def test_the_element_rule_holds_one_chunk_of_all_rows():
    """The CPU default and the chunk_elements override hold the logits exactly when N V <= the chunk."""
    n, d, v = 300, 40, 1021
    kw = {"mode": "generic", "strategy": "workspace"}
    assert P.plan_head(n, d, v, device="cpu", **kw).hold_logits
    assert P.plan_head(n, d, v, device="h200", chunk_elements=n * v, **kw).hold_logits
    split = P.plan_head(n, d, v, device="h200", chunk_elements=n * v - 1, **kw)
    assert not split.hold_logits and split.token_rows < n


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_coupled_loss_in_one_chunk_is_priced_6ndv(backend):
    """This release's fused loss runs a coupled loss's gradient pass on its statistics pass's chunk when one
    chunk holds every row (tests/test_losses_cost.py counts the FLOPs): 6NDV; two chunks recompute (8NDV)."""
    n, d, v = 2048, 4096, 151936
    kw = {"mode": "coupled", "device": "h100", "backend": backend, "kernels": P.KERNELS}
    if backend == "triton":
        kw["strategy"] = "workspace"
    one = P.plan_head(n, d, v, chunk_elements=n * v, **kw)
    two = P.plan_head(n, d, v, chunk_elements=n * v // 2, **kw)
    assert dict(one.terms)["gemm"] == pytest.approx(6 * n * d * v / 765e12)
    assert dict(two.terms)["gemm"] == pytest.approx(8 * n * d * v / 765e12, rel=0.02)
