"""The triton backend inside `torch.autocast` (the unit suite's tests/test_autocast.py checks the torch backend):
the head op, CISPO (fused and generic modes) and the divergence equal the same call outside autocast on the
operands cast to the autocast dtype; under the interpreter on CPU, and on CUDA in the GPU suite."""

from __future__ import annotations

import pytest
from _head_calls import calls
from _interp import DEVICE, MARKS
from test_autocast import check_autocast_equals_cast_operands

pytestmark = MARKS

CASES = calls("triton")


@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_casts_the_operands(name):
    check_autocast_equals_cast_operands(CASES[name], DEVICE)
