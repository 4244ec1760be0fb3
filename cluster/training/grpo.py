"""The one GRPO loss, shared by every trainer (PEFT and Unsloth). Pure functions of tensors: unit-tested by hand."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float], scale: bool = True) -> list[float] | None:
    """(reward - group mean) / (population std + 1e-6), or only centred when not `scale`; None when all rewards
    are equal (nothing to learn)."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std == 0.0:
        return None
    return [(r - mean) / (std + 1e-6) if scale else r - mean for r in rewards]


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
    loss_fn: str = "ppo",
    kl_penalty_coef: float = 0.0,
) -> LossParts:
    """The policy loss and k3 KL, summed over tokens where `mask` is true.

    ppo: -min(ratio * A, clip(ratio) * A). cispo (ART 0.5's default): -sg(clip(ratio)) * A * new_logprob.
    `old_logprobs` may hold NaN where the engine reported no logprob: there the ratio is taken against the
    detached new logprob (ratio 1, gradient of the plain policy gradient). With `kl_penalty_coef` (ART's
    KL-penalised advantage), each token's advantage gains coef * (mean KL - its KL), KL = new - ref (detached),
    the mean taken over this call's masked tokens.
    """
    mask = mask.to(new_logprobs.dtype)
    old = torch.where(torch.isnan(old_logprobs), new_logprobs.detach(), old_logprobs)
    ratio = torch.exp(new_logprobs - old)
    if kl_penalty_coef > 0 and ref_logprobs is not None:
        token_kl = (new_logprobs - ref_logprobs).detach() * mask
        mean_kl = token_kl.sum() / (mask.sum() + 1e-6)
        advantages = advantages + kl_penalty_coef * (mean_kl - token_kl) * mask
    bounded = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    if loss_fn == "cispo":
        per_token = -bounded.detach() * advantages * new_logprobs
        was_clipped = (bounded != ratio).to(mask.dtype)
    else:
        unclipped, clipped = ratio * advantages, bounded * advantages
        per_token = -torch.minimum(unclipped, clipped)
        was_clipped = (clipped < unclipped).to(mask.dtype)
    if ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = torch.exp(delta) - delta - 1.0
    else:
        kl = torch.zeros_like(per_token)
    return LossParts(policy=(per_token * mask).sum(), kl=(kl * mask).sum(), clipped=(was_clipped * mask).sum())
