"""Carries pretend-CUDA mode into child Python processes (see _pretend_cuda.py)."""

import _pretend_cuda

_pretend_cuda.install()
