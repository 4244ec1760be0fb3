"""The one GRPO loss, shared by every trainer (PEFT and Unsloth). Pure functions of tensors: unit-tested by hand."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float]) -> list[float] | None:
    """(reward - group mean) / (population std + 1e-6); None when all rewards are equal (nothing to learn)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std == 0.0:
        return None
    return [(r - mean) / (std + 1e-6) for r in rewards]


@dataclass
class LossParts:
    """Sums over the trained tokens of one micro-batch (divide by the batch's trained-token count)."""

    policy: torch.Tensor
    kl: torch.Tensor
    clipped: torch.Tensor


def grpo_loss_sums(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    ref_logprobs: torch.Tensor | None = None,
) -> LossParts:
    """Clipped policy loss and k3 KL, summed over tokens where `mask` is true.

    `old_logprobs` may hold NaN where the engine reported no logprob: there the ratio is taken against the
    detached new logprob (ratio 1, gradient of the plain policy gradient).
    """
    mask = mask.to(new_logprobs.dtype)
    old = torch.where(torch.isnan(old_logprobs), new_logprobs.detach(), old_logprobs)
    ratio = torch.exp(new_logprobs - old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = torch.exp(delta) - delta - 1.0
    else:
        kl = torch.zeros_like(per_token)
    was_clipped = (clipped < unclipped).to(mask.dtype)
    return LossParts(policy=(per_token * mask).sum(), kl=(kl * mask).sum(), clipped=(was_clipped * mask).sum())
