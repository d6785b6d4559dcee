"""Measure one (implementation, workload, shape) case; run by the runner in a process of its own (CPU) or
in the runner's process (`Options.in_process`, the GPU presets).

Inputs: `make_inputs` on the case's device, built once per shape and workload in a process that measures
several cases (`shape_inputs`); each case times fresh leaves cloned from them.
Timing: `warmup` untimed runs, then `repeats` timed forward+backward runs (on CUDA between two CUDA
events, on CPU by the host clock); the result keeps every time, their median and minimum. Peak memory: on
CPU the process's peak resident set (VmHWM) since the inputs were built (the peak is reset then, so it
counts the inputs, the gradients and every transient of the runs, not the setup); on CUDA
`torch.cuda.max_memory_allocated` since the same point, and `base_bytes` the memory allocated then (the
inputs), so peak - base is the extra memory of the step (gradients and transients).
Errors: after timing, the implementation runs once more on a sub-sample (the first `check_tokens`
tokens, or the sequences that hold them) and its logprob / entropy / loss / gradients are compared with
the float64 reference (`ludic_fast.reference` on float64 hidden and weight) as max |difference|; the
gradients also relative to max |reference|.

    python -m ludic_fast.benchmark.worker '<json spec>'    # prints one line: RESULT <json>
"""

from __future__ import annotations

import contextlib
import json
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ludic_fast.benchmark.impls import get_impl, preload, reference_loss
from ludic_fast.benchmark.workloads import Inputs, Shape, Workload, get_workload, make_inputs

RESULT_PREFIX = "RESULT "


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak bytes since `reset()`: CUDA allocator peak, or the process's peak RSS on CPU."""

    def __init__(self, device: str):
        self.device = device
        self.resettable = True
        self.base = 0

    def reset(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.resettable = False
        self.base = 1024 * (_status_kib("VmRSS") or 0)

    def peak(self) -> int:
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated())
        hwm = _status_kib("VmHWM")
        if hwm is None:
            return 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return 1024 * hwm


def _run_once(step, inp: Inputs, device: str) -> tuple[float, dict[str, Tensor]]:
    for leaf in inp.leaves():
        leaf.grad = None
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out
    t0 = time.perf_counter()
    out = step()
    return time.perf_counter() - t0, out


def _reference64(workload: Workload, sub: Inputs) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """Float64 outputs and (d hidden, d weight) of the workload on the sub-sample."""
    from ludic_fast import reference

    h = sub.hidden.detach().double().requires_grad_()
    w = sub.weight.detach().double().requires_grad_()
    if workload.kind == "distill":
        h_t, w_t = (t.detach().double() for t in sub.teacher)
        loss = reference.linear_divergence(h, w, h_t, w_t, **workload.loss_kwargs)
        loss.backward()
        return {"loss": loss.detach()}, h.grad, w.grad
    if workload.is_loss or workload.kind == "ce":
        logits = F.linear(h, w)
        if workload.kind == "ce":
            loss = F.cross_entropy(logits, sub.targets)
        else:
            loss, _ = reference_loss(workload)(sub.batch, logits=logits)
        loss.backward()
        return {"loss": loss.detach()}, h.grad, w.grad
    out = reference.linear_logprobs(h, w, sub.targets)
    ((out.logprobs * sub.g_lp.double()).sum() + (out.entropy * sub.g_h.double()).sum()).backward()
    return {"logprobs": out.logprobs.detach(), "entropy": out.entropy.detach()}, h.grad, w.grad


def _max_abs(a: Tensor, b: Tensor) -> float:
    return float((a.detach().double() - b.double()).abs().max()) if b.numel() else 0.0


def check_errors(impl_name: str, workload: Workload, inp: Inputs, check_tokens: int, device: str) -> dict[str, Any]:
    """Max |impl - float64 reference| of every output the implementation has, on a sub-sample."""
    if workload.is_loss:
        k = max(1, -(-check_tokens // inp.hidden.shape[1]))
        sub = inp.sequences(k + k % 2 if workload.kind == "pair" else k).fresh()  # pairs stay whole
    else:
        sub = inp.head_rows(check_tokens).fresh()
    step = get_impl(impl_name).build(workload, sub)
    _, out = _run_once(step, sub, device)
    ref, ref_dh, ref_dw = _reference64(workload, sub)
    errors: dict[str, Any] = {k: _max_abs(out[k], ref[k]) for k in ref if k in out}
    for key, leaf, ref_grad in (("grad_hidden", sub.hidden, ref_dh), ("grad_weight", sub.weight, ref_dw)):
        if leaf.grad is not None:
            err = _max_abs(leaf.grad, ref_grad)
            errors[key] = err
            errors[key + "_rel"] = err / max(float(ref_grad.abs().max()), 1e-30)
    errors["check_tokens"] = int(sub.targets.numel())
    return errors


#: the inputs of the shape measured last, by (workload, seed, device): cases of one shape share them
_SHAPE_INPUTS: dict[tuple[str, Shape, int, str], Inputs] = {}


def shape_inputs(workload: str, shape: Shape, seed: int, device: str) -> Inputs:
    """`make_inputs` built once per (workload, shape, seed, device) while one shape is measured (the runner
    walks shape by shape): a case of another shape frees the previous shape's inputs first."""
    key = (workload, shape, seed, device)
    if key not in _SHAPE_INPUTS:
        if any(k[1] != shape for k in _SHAPE_INPUTS):
            _SHAPE_INPUTS.clear()
        _SHAPE_INPUTS[key] = make_inputs(workload, shape, seed=seed, device=device)
    return _SHAPE_INPUTS[key]


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Time, peak memory and errors of one case. `spec`: impl, workload, shape (Shape fields), device,
    threads, repeats, warmup, check_tokens (0: skip the error check), seed. On CUDA the case runs with its
    device current, so the memory statistics, the CUDA events and every peer's launches are that device's."""
    device = torch.device(spec.get("device", "cpu"))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return _measure(spec)


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    impl = get_impl(spec["impl"])
    workload = get_workload(spec["workload"])
    shape = Shape(**spec["shape"])
    device = spec.get("device", "cpu")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    preload()
    inp = shape_inputs(workload.name, shape, int(spec.get("seed", 0)), device).fresh()
    step = impl.build(workload, inp)
    memory = PeakMemory(device)
    memory.reset()
    for _ in range(int(spec.get("warmup", 1))):
        _run_once(step, inp, device)
    times = [_run_once(step, inp, device)[0] for _ in range(int(spec.get("repeats", 3)))]
    result: dict[str, Any] = {
        "times_s": times,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "peak_bytes": memory.peak(),
        "base_bytes": memory.base,
        "peak_is_process_lifetime": not memory.resettable,
        "threads": torch.get_num_threads(),
    }
    del step
    check_tokens = int(spec.get("check_tokens", 256))
    if check_tokens > 0 and impl.role != "floor":
        result["errors"] = check_errors(impl.name, workload, inp, check_tokens, device)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m ludic_fast.benchmark.worker '<json spec>'")
    print(RESULT_PREFIX + json.dumps(measure(json.loads(argv[0]))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
