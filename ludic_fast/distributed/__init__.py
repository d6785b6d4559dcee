"""Beyond one machine: the vocab-parallel head (`vocab_parallel`), the Redis actor/learner pipeline
(`pipeline`) and weight publishing (`publish`).

Only the vocab-parallel head is imported here; `pipeline` and `publish` need the optional `redis` and
`msgpack` packages and are imported from their modules.
"""

from ludic_fast.distributed.vocab_parallel import (
    vocab_parallel_linear_logprobs,
    vocab_parallel_loss,
    vocab_partition,
)

__all__ = ["vocab_parallel_linear_logprobs", "vocab_parallel_loss", "vocab_partition"]
