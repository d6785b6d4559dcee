"""The non-finite guard: a step whose loss or gradient norm is not finite is skipped (weights, optimizer and
schedule untouched); a run whose loss stays non-finite for `max_nonfinite_steps` steps in a row, or whose
sampling meets non-finite probabilities, has diverged and stops with `NonFiniteError` naming the step and the
likely cause (a learning rate too high).

The empty-batch guard: a step whose whole batch holds no action token (every example's trained tokens cut by
`max_seq_len`, or none to begin with) would train nothing, with loss 0; it raises `EmptyBatchError` instead,
before the optimizer step.
"""

from __future__ import annotations

#: the message torch.multinomial raises on a probability row holding inf / nan / negative values
_SAMPLING_MESSAGE = "probability tensor contains"


class NonFiniteError(RuntimeError):
    """The run diverged; `str(exc)` is one line naming the step and the likely cause."""


class EmptyBatchError(ValueError):
    """A batch that leaves the step nothing to train; `str(exc)` is one line naming the cause."""


def no_action_tokens(step: int, examples: int, max_seq_len: int) -> EmptyBatchError:
    """The error of step `step`, whose batch of `examples` examples holds no action token."""
    return EmptyBatchError(
        f"step {step}: none of the batch's {examples} examples has an action token left to train (cut by "
        f"max_seq_len={max_seq_len}, --max-seq-len; with --env, --max-episode-tokens; or none to begin with): the "
        f"loss would be 0 and the step train nothing; raise the length limit or shorten the prompts"
    )


def diverged_loss(step: int, in_a_row: int, lr: float) -> NonFiniteError:
    """The error of a loss that was not finite for `in_a_row` steps up to `step`."""
    return NonFiniteError(
        f"step {step}: the loss was not finite for {in_a_row} steps in a row, the model's logits are inf/nan; "
        f"the likely cause is a learning rate too high (lr {lr:g})"
    )


def is_sampling_divergence(exc: BaseException) -> bool:
    """Whether `exc` is torch's refusal to sample from non-finite probabilities."""
    return isinstance(exc, RuntimeError) and _SAMPLING_MESSAGE in str(exc)


def diverged_sampling(step: int, lr: float) -> NonFiniteError:
    """The error of rollouts that met non-finite probabilities before step `step`."""
    return NonFiniteError(
        f"step {step}: sampling met inf/nan probabilities, the policy's logits are no longer finite; "
        f"the likely cause is a learning rate too high (lr {lr:g})"
    )


__all__ = ["EmptyBatchError", "NonFiniteError", "no_action_tokens", "diverged_loss", "diverged_sampling",
           "is_sampling_divergence"]
