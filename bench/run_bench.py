"""`python bench/run_bench.py [ludic-fast bench options]`: the same as `ludic-fast bench`; with no options it
writes the key CPU table (N=2048, D=896, V=151936, fp32, 2 threads, head op + CISPO, every
implementation) to bench/results/. See docs/benchmarks.md."""

from __future__ import annotations

import sys

from ludic_fast.benchmark.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["--preset", "key", "--out", "bench/results"]))
