"""Deprecated path: the preference losses live in `ludic_fast.losses.preference` (and are exported by
`ludic_fast.losses`). This module re-exports them, and `ludic_fast.preference.<submodule>` (dpo, dpo_terms,
kto, reference_free, wpo, common) names the same module objects as `ludic_fast.losses.preference.<submodule>`.
"""

from __future__ import annotations

import sys
import warnings

from ludic_fast.losses.preference import *  # noqa: F403 - the moved module's public names
from ludic_fast.losses.preference import (
    __all__,  # noqa: F401
    common,
    dpo,
    dpo_terms,
    kto,
    reference_free,
    wpo,
)

warnings.warn(
    "ludic_fast.preference is deprecated; import from ludic_fast.losses (or ludic_fast.losses.preference)",
    DeprecationWarning,
    stacklevel=2,
)

for _sub in (common, dpo, dpo_terms, kto, reference_free, wpo):
    sys.modules[f"{__name__}.{_sub.__name__.rsplit('.', 1)[1]}"] = _sub
del _sub
