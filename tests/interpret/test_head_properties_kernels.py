"""The property test of tests/test_head_properties.py on the Triton kernels (under TRITON_INTERPRET=1 on CPU,
or on CUDA): random small shapes (V down to 1), fp32, logit offsets up to 1e3, temperatures (scalar and per
token), softcaps, logit scales, masked columns, ignored rows, the generic op and the fused-loss mode, either
strategy, against the float64 computation."""

from __future__ import annotations

import pytest
import torch
from _interp import DEVICE, MARKS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_head_properties import cases, check_case

pytestmark = MARKS


@settings(max_examples=20, deadline=None, derandomize=True)
@given(c=cases(dtypes=(torch.float32,)), strategy=st.sampled_from(["fused", "workspace"]))
def test_triton_backend_matches_float64(c, strategy):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUDIC_FAST_TRITON_STRATEGY", strategy)
        check_case(c, "triton", DEVICE)
