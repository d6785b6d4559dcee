"""The property test of tests/test_divergence_properties.py on the Triton row kernel (under
TRITON_INTERPRET=1 on CPU, or on CUDA): random small shapes (V down to 1), fp32, logit offsets up to 1e3,
temperatures (scalar and per token), softcaps, logit scales, masked columns, ignored rows, hard labels, every
kind, against the float64 reference."""

from __future__ import annotations

import torch
from _interp import DEVICE, MARKS
from hypothesis import given, settings
from test_divergence_properties import cases, check_case

pytestmark = MARKS


@settings(max_examples=12, deadline=None, derandomize=True)
@given(c=cases(dtypes=(torch.float32,)))
def test_triton_backend_matches_float64(c):
    check_case(c, "triton", DEVICE)
