"""Losses under one roof: `ludic_fast.losses` exports every loss; each head-loss class has its exported twin in
`ludic_fast.reference` (found by listing, not by a second list); the moved paths still import, with a
DeprecationWarning, and name the very same objects."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

from ludic_fast import losses, reference
from ludic_fast.losses import preference


def _head_loss_classes(module) -> list[str]:
    def is_loss(obj: object) -> bool:
        return inspect.isclass(obj) and issubclass(obj, losses.HeadLoss) and obj is not losses.HeadLoss

    return sorted(name for name in module.__all__ if is_loss(getattr(module, name)))


def test_every_head_loss_has_an_exported_reference_twin():
    names = _head_loss_classes(losses)
    assert set(_head_loss_classes(preference)) <= set(names)  # every preference class is among them
    assert {"DPOLoss", "CPOLoss", "KTOLoss", "CISPOLoss", "SAPOLoss"} <= set(names)  # the listing finds classes
    missing = [n for n in names if n not in reference.__all__ or not callable(getattr(reference, n, None))]
    assert not missing, f"no exported twin in ludic_fast.reference for {missing}"


def test_one_import_holds_every_kind_of_loss():
    from ludic_fast.losses.reward import BradleyTerryLoss
    from ludic_fast.ops.divergence import linear_divergence

    assert losses.BradleyTerryLoss is BradleyTerryLoss
    assert losses.linear_divergence is linear_divergence
    assert losses.DPOLoss is preference.DPOLoss
    assert all(hasattr(losses, n) for n in losses.__all__)


_DEPRECATED = ("ludic_fast.preference", "ludic_fast.reward_model")


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_library_imports_no_deprecated_path():
    root = Path(losses.__file__).resolve().parents[1]
    shims = {root / "preference.py", root / "reward_model.py"}
    users = {
        str(f.relative_to(root.parent)): sorted(m for m in _imported_modules(f) if m.startswith(_DEPRECATED))
        for f in root.rglob("*.py") if f not in shims
    }
    assert {f: m for f, m in users.items() if m} == {}


_OLD_PATHS = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
import ludic_fast, ludic_fast.losses, ludic_fast.losses.preference.dpo_terms as new_terms
from ludic_fast.losses import reward as new_reward
for old in ("ludic_fast.preference", "ludic_fast.reward_model"):
    try:
        __import__(old)
    except DeprecationWarning as w:
        assert "deprecated; import from ludic_fast.losses" in str(w), w
    else:
        raise SystemExit(f"{old} imported without a DeprecationWarning")
warnings.simplefilter("ignore", DeprecationWarning)
import ludic_fast.preference.dpo_terms as old_terms
from ludic_fast.preference import DPOLoss, make_preference_loss
from ludic_fast.reward_model import BradleyTerryLoss, pair_reward_stats
assert old_terms is new_terms
assert DPOLoss is ludic_fast.losses.DPOLoss and make_preference_loss is ludic_fast.losses.make_preference_loss
assert BradleyTerryLoss is new_reward.BradleyTerryLoss and pair_reward_stats is new_reward.pair_reward_stats
print("ok")
"""


def test_moved_paths_import_with_a_deprecation_warning():
    out = subprocess.run([sys.executable, "-c", _OLD_PATHS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
