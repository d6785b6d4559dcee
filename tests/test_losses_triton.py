"""The fused losses on the triton backend (workspace strategy: GEMM + Triton row kernel) equal the reference:
on CPU through the Triton interpreter (its own process, TRITON_INTERPRET=1 set before triton is imported),
and on CUDA when a GPU is present."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NAMES = ["cispo", "token_clipped", "zvp_cispo", "gspo", "composite", "ppo_prompt_mis_seq_entropy"]
HEADS = [{}, {"softcap": 5.0, "temperature": 0.7, "logit_scale": 1.3}]

CHECK = """
import torch
from ludic_fast import reference as R
from test_losses_common import CASES, CASE_IDS, make_batch, rel_err

import ludic_fast.ops.fused_loss as fl

calls = []
_backward = fl._TritonRows.backward_
fl._TritonRows.backward_ = lambda self, *a: (calls.append(1), _backward(self, *a))[1]

def check(device, tol):
    for name in {names!r}:
        _, ours, ref = CASES[CASE_IDS.index(name)]
        for head in {heads!r}:
            batch, h, W, b = make_batch(0)
            ref_loss = ref(batch, logits=R.head_logits(h, W, b, **head))[0]
            ref_grads = torch.autograd.grad(ref_loss, (h, W, b))
            on = lambda x: x.detach().to(device).requires_grad_(True)
            hd, Wd, bd = on(h), on(W), on(b)
            batch_d = {{k: v.to(device) for k, v in batch.items()}}
            loss, _ = ours(batch_d, hidden=hd, weight=Wd, bias=bd, backend="triton", chunk_elements=16 * 37, **head)
            grads = torch.autograd.grad(loss, (hd, Wd, bd))
            assert rel_err(loss.cpu(), ref_loss) <= tol, (name, head, "loss")
            for g, rg in zip(grads, ref_grads):
                assert rel_err(g.cpu(), rg) <= tol, (name, head, rel_err(g.cpu(), rg))
    assert calls, "the triton chunk code did not run"
"""


def test_triton_backend_under_interpreter():
    pytest.importorskip("triton")
    probe = "import sys\nsys.path.insert(0, 'interpret')\nfrom _interp import PROBLEM\n"
    probe += "if PROBLEM:\n    print('SKIP ' + PROBLEM)\n    raise SystemExit(0)\n"
    script = probe + CHECK.format(names=NAMES, heads=HEADS) + "\ncheck('cpu', 1e-5)\nprint('ok')\n"
    # CPU tensors only: hide any GPU from the interpreter process, so that triton's runtime and torch pick the
    # CPU on a CUDA machine as on one without; one BLAS thread (the interpreter's tl.dot spins otherwise)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent, env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode == 0 and out.stdout.startswith("SKIP "):
        pytest.skip(out.stdout[5:].strip())
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout[-2000:], out.stderr[-4000:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_backend_on_cuda():
    pytest.importorskip("triton")
    namespace: dict = {}
    sys.path.insert(0, str(Path(__file__).parent))
    exec(CHECK.format(names=NAMES, heads=HEADS), namespace)  # noqa: S102 (our own test code)
    namespace["check"]("cuda", 1e-4)  # cuBLAS fp32 GEMMs may use a different summation order
