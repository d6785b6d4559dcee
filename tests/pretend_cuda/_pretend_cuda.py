"""Pretend-CUDA mode of the test suite (LUDIC_FAST_PRETEND_CUDA=1): a CPU-only torch that says it has one
CUDA device, so that any code path that silently picks CUDA by default fails loudly ("Torch not compiled
with CUDA enabled") instead of passing on a CPU machine and switching device on a GPU one.

Only `torch.cuda.is_available` (-> True) and `torch.cuda.device_count` (-> 1) are patched: they are what
ludic_fast, transformers, accelerate, deepspeed (its accelerator choice, unless DS_ACCELERATOR names one) and
triton's driver consult to choose a device; anything that then really uses CUDA (a tensor on "cuda", the CUDA
RNG, device properties) reaches torch's own lazy CUDA initialisation and raises. Triton's driver then claims
CUDA too, so kernels run only under its interpreter (TRITON_INTERPRET=1), as on a CPU machine. torch's own
bookkeeping (dynamo, the optimizers' graph-capture check) is told the truth (BOOKKEEPING below). A process with
CUDA_VISIBLE_DEVICES="" (or "-1") sees no device, as on a real GPU machine. Child Python processes inherit the
mode through this folder's sitecustomize.py (the test conftest puts the folder on PYTHONPATH)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "LUDIC_FAST_PRETEND_CUDA"


def active() -> bool:
    """True when the switch is on and CUDA_VISIBLE_DEVICES does not hide every device."""
    return os.environ.get(ENV) == "1" and os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")


# torch's own bookkeeping that asks about CUDA without choosing a device for anyone's tensors (dynamo saves and
# restores the CUDA RNG around every compiled frame and asks whether triton could target the GPU; every optimizer
# step asks whether a CUDA graph is being captured, which a CUDA build of torch without a driver cannot answer):
# it is told the truth, as on a GPU machine those calls simply succeed
BOOKKEEPING = ("torch._dynamo", "torch.utils._triton", "torch.optim")


def _pretends(truthful: tuple = ()) -> bool:
    """False when the caller of the patched function (past torch.accelerator's helpers, through which torch >=
    2.15's optimizers ask) is torch's bookkeeping or runs one of the `truthful` code objects, else True."""
    caller = sys._getframe(2)
    while caller.f_globals.get("__name__", "").startswith("torch.accelerator") and caller.f_back is not None:
        caller = caller.f_back
    return not (caller.f_globals.get("__name__", "").startswith(BOOKKEEPING) or caller.f_code in truthful)


def patch(torch) -> None:
    """Make `torch` report one CUDA device (its CUDA calls still raise on a CPU-only build)."""
    is_available, device_count = torch.cuda.is_available, torch.cuda.device_count
    if getattr(is_available, "pretend_cuda", False):
        return

    def pretend_is_available() -> bool:
        return True if _pretends() else is_available()

    # under PYTORCH_NVML_BASED_CUDA_CHECK=1 (deepspeed sets it on import) torch's own is_available counts devices
    # through the module's device_count: that count is the truth, so is_available's answer stays the truth
    real_is_available = (is_available.__code__,)

    def pretend_device_count() -> int:
        return 1 if _pretends(real_is_available) else device_count()

    pretend_is_available.pretend_cuda = True
    torch.cuda.is_available, torch.cuda.device_count = pretend_is_available, pretend_device_count


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    """Finds `torch` on sys.path and patches it as soon as its module has executed (a find_spec probe without
    an import, as transformers makes, leaves the finder in place for the real import)."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_then_patch(module):
                exec_module(module)
                patch(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)

            spec.loader.exec_module = exec_then_patch
        return spec


def install() -> bool:
    """Patch torch now if it is imported, else when it is; False (and nothing done) when the mode is off."""
    if not active():
        return False
    if "torch" in sys.modules:
        patch(sys.modules["torch"])
    elif not any(isinstance(f, _PatchTorchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchTorchOnImport())
    return True
