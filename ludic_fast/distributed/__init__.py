"""Beyond one machine: the vocab-parallel head (`vocab_parallel`), the Redis actor/learner pipeline
(`pipeline`), weight publishing (`publish`) and a step's macro-batch totals over data-parallel ranks
(`macro`).

Imported here: the vocab-parallel head, `reduce_stats_across_ranks` (Ludic's cross-rank stats rule) and
`Rank0Publisher`; `pipeline` and `publish` need the optional `redis` and `msgpack` packages and are imported
from their modules.
"""

from ludic_fast.distributed.rank0 import Rank0Publisher
from ludic_fast.distributed.stats import reduce_stats_across_ranks
from ludic_fast.distributed.vocab_parallel import (
    vocab_parallel_linear_logprobs,
    vocab_parallel_loss,
    vocab_partition,
)

__all__ = [
    "Rank0Publisher",
    "reduce_stats_across_ranks",
    "vocab_parallel_linear_logprobs",
    "vocab_parallel_loss",
    "vocab_partition",
]
