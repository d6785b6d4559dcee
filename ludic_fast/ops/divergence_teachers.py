"""The teacher of `linear_divergence`, one chunk of token rows at a time, as tempered log-probs.

- `HeadTeacher`: hidden states and an LM head; z_t = softcap(logit_scale (h_t W_t^T + b_t)) / T over the
  student's V columns (a teacher head with more rows, e.g. padded to a multiple of 64, has its extra rows
  dropped: its distribution is renormalised over the shared vocabulary), t = log_softmax(z_t).
- `DenseTeacher`: probabilities p [N, V'] (V' >= V, extra columns dropped), t = log_softmax(log p / T):
  rows need not sum to 1 exactly, zeros are zero-mass columns.
- `TopKTeacher`: top-k token ids and their log-probs [N, k]. Tail 'renormalize': the teacher conditioned on
  its top k, t = log_softmax(lp / T) there and -inf elsewhere. Tail 'bucket': the k tokens plus one outcome
  for every other token, of mass 1 - Σ_k e^{lp} (clamped at 0; temperature 1 only, since the tempered
  tail mass is unknown): `coarse` gives those k + 1 log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ludic_fast.ops.torch_head import HeadTransform, gemm_f32


def raw_logits(h: Tensor, W: Tensor, b: Tensor | None, acc: torch.dtype) -> Tensor:
    """h W^T + b as a fresh acc-dtype chunk (fp32 output GEMM for bf16/fp16 CUDA operands)."""
    z = (h.to(acc) @ W.to(acc).T) if acc == torch.float64 else gemm_f32(h, W.T.to(h.dtype))
    return z if b is None else z.add_(b.to(z.dtype))


def acc_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 when any tensor is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@dataclass(frozen=True)
class HeadTeacher:
    h: Tensor  # [N, D_t], detached
    W: Tensor  # [V, D_t], the student's V rows
    b: Tensor | None

    def kernel_input(self, rows: slice) -> tuple[Tensor, Tensor | None, bool]:
        """(fp32 raw logits chunk, fp32 bias or None, True: logits) for the Triton row kernel."""
        h = self.h[rows]
        return (gemm_f32(h, self.W.T.to(h.dtype)).contiguous(), None if self.b is None else self.b.float().contiguous(),
                True)

    def log_probs(self, rows: slice, transform: HeadTransform, dtype: torch.dtype) -> Tensor:
        z = raw_logits(self.h[rows], self.W, self.b, acc_dtype(self.h, self.W)).to(dtype)
        z = transform.apply_(z, rows)
        return z.sub_(torch.logsumexp(z, 1, keepdim=True))


def _tempered_log_softmax_(t: Tensor, rows: slice, transform: HeadTransform) -> Tensor:
    if not transform.unit_temperature:
        t.mul_(transform.inv_temperature[rows, None].to(t.dtype))
    return t.sub_(torch.logsumexp(t, 1, keepdim=True))


@dataclass(frozen=True)
class DenseTeacher:
    probs: Tensor  # [N, V'], detached
    V: int

    def kernel_input(self, rows: slice) -> tuple[Tensor, Tensor | None, bool]:
        """(fp32 log p chunk, no bias, False: log-probs) for the Triton row kernel."""
        return self.probs[rows, : self.V].float().log().contiguous(), None, False

    def log_probs(self, rows: slice, transform: HeadTransform, dtype: torch.dtype) -> Tensor:
        return _tempered_log_softmax_(self.probs[rows, : self.V].to(dtype).log(), rows, transform)


@dataclass(frozen=True)
class TopKTeacher:
    idx: Tensor  # [N, k] int64
    lp: Tensor  # [N, k], detached
    V: int
    bucket: bool

    def _scattered(self, rows: slice, dtype: torch.dtype) -> Tensor:
        idx = self.idx[rows]
        t = torch.full((idx.shape[0], self.V), float("-inf"), dtype=dtype, device=idx.device)
        return t.scatter_(1, idx, self.lp[rows].to(dtype))

    def kernel_input(self, rows: slice) -> tuple[Tensor, Tensor | None, bool]:
        """(fp32 log-probs chunk, -inf off the top k; no bias; False: log-probs) for the Triton row kernel
        (tail 'renormalize')."""
        return self._scattered(rows, torch.float32), None, False

    def log_probs(self, rows: slice, transform: HeadTransform, dtype: torch.dtype) -> Tensor:
        return _tempered_log_softmax_(self._scattered(rows, dtype), rows, transform)

    def coarse(self, rows: slice, dtype: torch.dtype) -> Tensor:
        """[n, k + 1] log-probs: the top-k tokens, then the tail (module docstring)."""
        lp = self.lp[rows].to(torch.float64)
        tail = torch.log(torch.clamp(-torch.expm1(torch.logsumexp(lp, 1, keepdim=True)), min=0.0))
        t = torch.cat([lp, tail], 1)
        return t.sub_(torch.logsumexp(t, 1, keepdim=True)).to(dtype)


Teacher = HeadTeacher | DenseTeacher | TopKTeacher

__all__ = ["HeadTeacher", "DenseTeacher", "TopKTeacher", "Teacher", "raw_logits", "acc_dtype"]
