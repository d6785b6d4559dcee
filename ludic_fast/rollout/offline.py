"""Deprecated path: the batch source of recorded data lives in `ludic_fast.rollout.dataset_source`
(OfflineBatchSource is DatasetBatchSource). Importing this module gives that module itself."""

from ludic_fast._deprecation import moved_module
from ludic_fast.rollout import dataset_source

moved_module(__name__, dataset_source, "OfflineBatchSource is DatasetBatchSource")
