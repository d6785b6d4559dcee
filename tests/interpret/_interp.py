"""Shared setup of the Triton kernel tests: they run under the interpreter on CPU (TRITON_INTERPRET=1) or on
a CUDA GPU, and are skipped otherwise (or when the installed triton's interpreter cannot run our kernels)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def interpreter_problem() -> str | None:
    """None when triton's interpreter runs a loop over a runtime bound, the pattern of every kernel here;
    otherwise why not. (triton 3.6's interpreter converts the bound with int() of a 1-element array, which
    numpy >= 2.4 rejects; later triton releases squeeze it first.)"""
    import numpy as np
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(x_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, n, BLOCK):
            acc += tl.load(x_ptr + i + tl.arange(0, BLOCK))
        tl.store(x_ptr + tl.arange(0, BLOCK), acc)

    x = torch.ones(8)
    try:
        _probe[(1,)](x, 8, BLOCK=4)
    except Exception as exc:  # the interpreter wraps the numpy TypeError in its own error type
        return (f"triton {triton.__version__}'s interpreter cannot run a loop over a runtime bound with numpy "
                f"{np.__version__} ({type(exc).__name__}); use a newer triton to run the kernels on CPU")
    return None if float(x[0]) == 2.0 else "triton's interpreter computed a wrong sum in the probe kernel"


PROBLEM = interpreter_problem() if INTERPRET else None
MARKS = [
    pytest.mark.interpret,
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(),
        reason="needs a CUDA GPU or TRITON_INTERPRET=1 (the Triton interpreter)",
    ),
    pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM)),
]
#: whether the kernels run with sm_90 launch configs here (the TMA variant's only architecture): on a CUDA GPU
#: of compute capability 9+, and on the CPU, where the interpreter runs the sm_90 configs
SM90 = DEVICE == "cpu" or (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
