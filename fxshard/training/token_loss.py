"""The training loss of a causal LM, shared by the trainer's loop and the planner's
measurements (one definition, so the planner predicts the loss the trainer takes): the
cross-entropy summed over the scored tokens, to be divided by the global count of scored
tokens, so that every mesh, accumulation and padding gives one device's numbers.

Example::

    loss = token_loss_sum(program(input_ids=ids), labels) / scored_tokens
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fxshard.runtime.loss import vocab_parallel_token_losses


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab_axis: str | None = None,
                   vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy summed over the scored tokens (labels pre-shifted; -100 is padding).

    ``vocab_axis``: the logits are this rank's vocab shard on that mesh axis (a program with
    loss parallel, ``Program.vocab_parallel``): the vocab-parallel cross-entropy takes the
    loss in pieces (max, sum of exponentials and target logit all-reduced per token), never
    gathering the logits; ``vocab_size`` is the global vocabulary (uneven shards).

    Example: ``token_loss_sum(program(input_ids=ids), labels, *program_info.vocab_parallel or ())``
    """
    logits = getattr(logits, "logits", logits)  # an HF ModelOutput, or a logits tensor
    if vocab_axis is not None:
        # fp32 inside, per token: no fp32 copy of the logits is kept for the backward
        return vocab_parallel_token_losses(logits.flatten(0, -2), labels.flatten(), vocab_axis, ignore_index=-100,
                                           vocab_size=vocab_size).sum()
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum")


__all__ = ["token_loss_sum"]
