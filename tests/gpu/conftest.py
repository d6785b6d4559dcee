"""The GPU suite (`make test-gpu`): every CUDA path of the package against `ludic_fast.reference`.

Each test takes a `device` parameter: the CUDA variants are marked `gpu` and skip without CUDA (the reason
names it); the CPU variants run the same bodies at small shapes on the CPU, so the suite is exercised in CI
too. The shared loss fixtures live one folder up (tests/)."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent.parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
