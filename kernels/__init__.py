"""Triton kernels of ludic_fast (installed as `ludic_fast.kernels`): @triton.jit functions and thin
launchers only; autograd and dispatch live in `ludic_fast.ops`."""
