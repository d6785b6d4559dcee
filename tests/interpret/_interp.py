"""Shared setup of the Triton kernel tests: they run under the interpreter on CPU (TRITON_INTERPRET=1) or on
a CUDA GPU, and are skipped otherwise."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
MARKS = [
    pytest.mark.interpret,
    pytest.mark.skipif(
        not INTERPRET and not torch.cuda.is_available(),
        reason="needs a CUDA GPU or TRITON_INTERPRET=1 (the Triton interpreter)",
    ),
]
