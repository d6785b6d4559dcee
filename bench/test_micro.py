"""pytest-benchmark micro-benchmarks of the head's hot operations (not part of `make test`):

    .venv/bin/pytest bench/ --benchmark-only            # add --benchmark-json=out.json to keep the numbers

Shapes are small (one chunk of tokens x a 32k vocabulary) so the whole file runs in about a minute on 2
cores. Each group compares our building block with the plain-PyTorch way of doing the same thing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("pytest_benchmark")

from ludic_fast import linear_logprobs, reference  # noqa: E402
from ludic_fast.benchmark.impls import get_impl  # noqa: E402
from ludic_fast.benchmark.workloads import Shape, get_workload, make_inputs  # noqa: E402
from ludic_fast.ops.torch_head import ChunkedHead, HeadTransform  # noqa: E402

N, D, V = 256, 256, 32000
SHAPE = Shape(n=N, d=D, v=V, seq_len=128)


@pytest.fixture(scope="module")
def head_case():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g)
    W = torch.randn(V, D, generator=g) / D**0.5
    y = torch.randint(0, V, (N,), generator=g)
    transform = HeadTransform(1.0, None, torch.ones(N, dtype=torch.float64))
    return h, W, y, ChunkedHead(h, W, None, y, transform, None, -100)


@pytest.mark.benchmark(group="chunk: logits + online statistics")
def test_chunk_stats(benchmark, head_case):
    h, _, _, head = head_case
    rows = slice(0, N)
    benchmark(head.stats, h, rows, True)


@pytest.mark.benchmark(group="chunk: logits + online statistics")
def test_chunk_log_softmax_torch(benchmark, head_case):
    h, W, y, _ = head_case
    benchmark(lambda: reference.logprobs_from_logits(h @ W.T, y))


@pytest.mark.benchmark(group="chunk: dz and the two gradient GEMMs")
def test_chunk_grad_and_accumulate(benchmark, head_case):
    h, W, _, head = head_case
    rows, cols = slice(0, N), slice(0, V)
    lse, elp, _, _ = head.stats(h, rows, True)
    g_lp, g_H = torch.ones(N), torch.full((N,), 0.1)
    dh, dW = torch.zeros(N, D), torch.zeros(V, D)

    def run():
        z = head.logits(h, rows, cols)
        head.accumulate_(head.grad_raw_(z, rows, cols, lse, elp, g_lp, g_H), h, rows, cols, dh, dW, None)

    benchmark(run)


@pytest.mark.benchmark(group="chunk: dz and the two gradient GEMMs")
def test_chunk_three_bare_gemms(benchmark, head_case):
    h, W, _, _ = head_case
    benchmark(lambda: ((z := h @ W.T) @ W, z.T @ h))


def _fwd_bwd(impl: str, workload: str):
    inp = make_inputs(workload, SHAPE).fresh()
    step = get_impl(impl).build(get_workload(workload), inp)

    def run():
        inp.hidden.grad = inp.weight.grad = None
        step()

    return run


@pytest.mark.benchmark(group="head op fwd+bwd")
@pytest.mark.parametrize("impl", ["ours-generic", "reference"])
def test_head_fwd_bwd(benchmark, impl):
    benchmark(_fwd_bwd(impl, "head"))


@pytest.mark.benchmark(group="CISPO fwd+bwd")
@pytest.mark.parametrize("impl", ["ours-fused", "ours-generic", "reference"])
def test_cispo_fwd_bwd(benchmark, impl):
    benchmark(_fwd_bwd(impl, "cispo"))


@pytest.mark.benchmark(group="head op forward only")
def test_head_forward_ours(benchmark, head_case):
    h, W, y, _ = head_case
    with torch.no_grad():
        benchmark(linear_logprobs, h, W, y, backend="torch")


@pytest.mark.benchmark(group="head op forward only")
def test_head_forward_reference(benchmark, head_case):
    h, W, y, _ = head_case
    with torch.no_grad():
        benchmark(lambda: reference.logprobs_from_logits(F.linear(h, W), y))
