"""Benchmarks users can trust: ours vs the reference vs peers vs the bare-GEMM floor.

Each (implementation, workload, shape) case runs in its own process (`runner`, `worker`): median and min
of k forward+backward runs after warm-up, peak memory (process peak RSS on CPU, CUDA allocator peak on
GPU), and max errors against a float64 reference on a sub-sample. `report` turns the results into
markdown tables with every ratio (ours / reference, ours / peer, ours / GEMM floor) and PNG plots of time
and memory against N and V; `cli.main` is `ludic-fast bench`.
"""

from ludic_fast.benchmark.impls import IMPLS, Impl
from ludic_fast.benchmark.runner import CaseResult, Options, run_case, run_suite
from ludic_fast.benchmark.workloads import WORKLOADS, Shape, Workload, make_inputs

__all__ = ["IMPLS", "Impl", "CaseResult", "Options", "run_case", "run_suite", "WORKLOADS", "Shape", "Workload",
           "make_inputs"]
