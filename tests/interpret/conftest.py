"""Interpreter-test setup. The Triton interpreter runs tl.dot through numpy's BLAS; a multi-threaded
OpenBLAS on a busy 2-core machine spins (~1000x slower on 128x64 tiles), so pin it to one thread before
numpy is first imported (pytest imports this file before the test modules); and patch triton.language once per
kernel launch rather than at every helper call (`_patch_once`: half the interpreter's time). The head-gradient
helper shared with the GPU suite lives one folder up (tests/)."""

import os
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent.parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

if "numpy" not in sys.modules:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    from _patch_once import install

    install()
