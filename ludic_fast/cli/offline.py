"""Deprecated path: running the dataset presets lives in `ludic_fast.cli.dataset_presets`. Importing this module
gives that module itself."""

from ludic_fast._deprecation import moved_module
from ludic_fast.cli import dataset_presets

moved_module(__name__, dataset_presets)
