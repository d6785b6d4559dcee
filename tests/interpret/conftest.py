"""Interpreter-test setup. The Triton interpreter runs tl.dot through numpy's BLAS; a multi-threaded
OpenBLAS on a busy 2-core machine spins (~1000x slower on 128x64 tiles), so pin it to one thread before
numpy is first imported (pytest imports this file before the test modules)."""

import os
import sys

if "numpy" not in sys.modules:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
