"""How slow this machine is now, for the tests whose subprocesses run under wall-clock budgets (a suite's
--seconds, a stage's outer `timeout`): their budgets are multiplied by `slowdown()`, so a machine loaded by other
work gives them proportionally more time instead of failing them."""

from __future__ import annotations

import math
import subprocess
import sys
import time

#: seconds `python -c "import torch, pytest"` takes on a quiet 2-core machine (1.7 s measured)
QUIET_START_S = 2.0


def slowdown() -> int:
    """ceil(t / QUIET_START_S) >= 1, t the time a fresh interpreter takes to import torch and pytest now."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, pytest"], check=True, capture_output=True)
    return max(1, math.ceil((time.perf_counter() - t0) / QUIET_START_S))
