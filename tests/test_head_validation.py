"""Bad input to the head op gets a ValueError/TypeError that names the argument."""

from __future__ import annotations

import pytest
import torch

import ludic_fast
from ludic_fast import reference


def _ok():
    return torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))


@pytest.mark.parametrize("fn", [ludic_fast.linear_logprobs, reference.linear_logprobs])
@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda h, W, y, kw: (h.long(), W, y, kw), TypeError, "hidden"),
        (lambda h, W, y, kw: (h, W.int(), y, kw), TypeError, "weight"),
        (lambda h, W, y, kw: (h, W, y.float(), kw), TypeError, "targets"),
        (lambda h, W, y, kw: (h[:, :7], W, y, kw), ValueError, "hidden"),
        (lambda h, W, y, kw: (h, W, y[:3], kw), ValueError, "targets"),
        (lambda h, W, y, kw: (h, W[0], y, kw), ValueError, "weight"),
        (lambda h, W, y, kw: (h, W[:0], y, kw), ValueError, "V > 0"),
        (lambda h, W, y, kw: (h[:, :0], W[:, :0], y, kw), ValueError, "D > 0"),
        (lambda h, W, y, kw: (h, W, y.clone().fill_(11), kw), ValueError, "targets must lie"),
        (lambda h, W, y, kw: (h, W, y.clone().fill_(-1), kw), ValueError, "targets must lie"),
        (lambda h, W, y, kw: (h, W, y, {"temperature": 0.0}), ValueError, "temperature"),
        (lambda h, W, y, kw: (h, W, y, {"temperature": torch.tensor([1.0, 1, -1, 1])}), ValueError, "temperature"),
        (lambda h, W, y, kw: (h, W, y, {"temperature": torch.ones(3)}), ValueError, "temperature"),
        (lambda h, W, y, kw: (h, W, y, {"softcap": -1.0}), ValueError, "softcap"),
        (lambda h, W, y, kw: (h, W, y, {"bias": torch.ones(10)}), ValueError, "bias"),
        (lambda h, W, y, kw: (h, W, y, {"logit_scale": "2"}), TypeError, "logit_scale"),
    ],
)
def test_bad_input_names_the_argument(fn, mutate, exc, match):
    h, W, y, kw = mutate(*_ok(), {})
    with pytest.raises(exc, match=match):
        fn(h, W, y, **kw)


def test_bad_backend_and_triton_off_cuda():
    h, W, y = _ok()
    with pytest.raises(ValueError, match="backend"):
        ludic_fast.linear_logprobs(h, W, y, backend="cuda")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ludic_fast.linear_logprobs(h, W, y, backend="triton")


def test_bad_reduction_and_chunk_budget():
    h, W, y = _ok()
    with pytest.raises(ValueError, match="reduction"):
        ludic_fast.linear_cross_entropy(h, W, y, reduction="avg")
    with pytest.raises(ValueError, match="chunk_elements"):
        ludic_fast.linear_logprobs(h, W, y, chunk_elements=0)


@pytest.mark.parametrize("bad", [0, -5, "lots", "4 parsecs", ""])
def test_bad_memory_budget_names_the_argument(bad):
    h, W, y = _ok()
    with pytest.raises(ValueError, match="memory_budget"):
        ludic_fast.linear_logprobs(h, W, y, memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget"):
        ludic_fast.linear_cross_entropy(h, W, y, memory_budget=bad)


@pytest.mark.parametrize("bad", [1.5e9, True, [4]])
def test_memory_budget_of_the_wrong_type(bad):
    h, W, y = _ok()
    with pytest.raises(TypeError, match="memory_budget"):
        ludic_fast.linear_logprobs(h, W, y, memory_budget=bad)


def test_ignore_index_is_exempt_from_range_check():
    h, W, y = _ok()
    y[1] = -100
    out = ludic_fast.linear_logprobs(h, W, y)
    assert float(out.logprobs[1]) == 0.0
