"""Deprecated path: the base of the dataset objectives lives in `ludic_fast.objectives.dataset` (OfflineObjective
is DatasetObjective). Importing this module gives that module itself."""

from ludic_fast._deprecation import moved_module
from ludic_fast.objectives import dataset

moved_module(__name__, dataset, "OfflineObjective is DatasetObjective")
