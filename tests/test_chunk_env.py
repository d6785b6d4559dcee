"""LUDIC_FAST_CHUNK_ELEMENTS is read at call time: changing it after import changes the next call's chunks."""

from __future__ import annotations

import pytest
import torch

import ludic_fast
from ludic_fast.ops.budget import DEFAULT_CHUNK_ELEMENTS, chunk_plan, default_chunk_elements


def test_env_override_read_per_call(monkeypatch):
    monkeypatch.delenv("LUDIC_FAST_CHUNK_ELEMENTS", raising=False)
    assert default_chunk_elements() == DEFAULT_CHUNK_ELEMENTS == 64 * 2**20
    assert chunk_plan(4096, 1000, None) == (4096, 1000)  # 4096 x 1000 fits 64 Mi: one chunk
    monkeypatch.setenv("LUDIC_FAST_CHUNK_ELEMENTS", "32000")
    assert default_chunk_elements() == 32000 and chunk_plan(4096, 1000, None) == (32, 1000)
    assert chunk_plan(4096, 1000, 64000) == (64, 1000)  # an explicit chunk_elements= wins over the env


@pytest.mark.parametrize("raw", ["0", "-5", "lots"])
def test_env_override_must_be_a_positive_integer(monkeypatch, raw):
    monkeypatch.setenv("LUDIC_FAST_CHUNK_ELEMENTS", raw)
    with pytest.raises(ValueError, match="LUDIC_FAST_CHUNK_ELEMENTS must be a positive integer"):
        default_chunk_elements()


def test_head_results_do_not_depend_on_the_override(monkeypatch):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(40, 8, generator=g), torch.randn(50, 8, generator=g)
    y = torch.randint(0, 50, (40,), generator=g)
    monkeypatch.delenv("LUDIC_FAST_CHUNK_ELEMENTS", raising=False)
    whole = ludic_fast.linear_logprobs(h, w, y, backend="torch")
    monkeypatch.setenv("LUDIC_FAST_CHUNK_ELEMENTS", "160")  # 16-token chunks of 10-column slices
    chunked = ludic_fast.linear_logprobs(h, w, y, backend="torch")
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.entropy, whole.entropy, rtol=1e-5, atol=1e-5)
