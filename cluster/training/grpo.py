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


LOG_RATIO_BOUND = 20.0  # |new - old| beyond this is clamped before exp (ART's bound for float32 logprobs)


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
    kl_penalty_source: str = "current_learner",
    importance_sampling_level: str = "token",
    segments: torch.Tensor | None = None,
    old_policy: str = "sampler",
    truncated_importance_sampling: float | None = None,
) -> LossParts:
    """The policy loss and k3 KL, summed over tokens where `mask` is true. ART's loss (art/loss.py), every variant.

    ppo: -min(ratio * A, clip(ratio) * A). cispo (ART's default): -sg(clip(ratio)) * A * new_logprob.
    `old_logprobs` are the engine's (the sampler's); NaN where it reported none: there the ratio is taken against
    the detached new logprob (ratio 1, the plain policy gradient).

    `importance_sampling_level`: "token" (each token's ratio), "sequence" (GSPO: exp of the mean log-ratio over the
    trained tokens of the token's sequence, `segments` giving each token's sequence id; default: its row),
    "average" (the mean of the two) or "geometric_average" (their geometric mean).

    `kl_penalty_coef` (ART's KL-penalised advantage): each token's advantage gains coef * (mean KL - its KL), KL =
    source - ref (detached), the mean over this call's masked tokens; the source is the policy being trained
    ("current_learner") or the sampler's logprobs ("sample").

    `old_policy` "trainer" (ART's precalculate_logprobs): the ratio is taken against the trainer's own logprobs at the
    start of the step, which are the detached new ones (one optimizer step per call). `truncated_importance_sampling`
    C (ART's) implies it and weights each token's loss by min(exp(trainer - sampler), C): the correction for the
    sampler (vLLM) and the trainer disagreeing on the same weights.
    """
    mask = mask.to(new_logprobs.dtype)
    detached = new_logprobs.detach()
    sampler = torch.where(torch.isnan(old_logprobs), detached, old_logprobs)
    old = detached if old_policy == "trainer" or truncated_importance_sampling else sampler
    log_ratio = (new_logprobs - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    if importance_sampling_level != "token":
        sequence_ratio = torch.exp(_segment_mean(log_ratio, mask, segments).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        ratio = {
            "sequence": sequence_ratio,
            "average": (ratio + sequence_ratio) / 2,
            "geometric_average": ratio.sqrt() * sequence_ratio.sqrt(),
        }[importance_sampling_level]
    if kl_penalty_coef > 0 and ref_logprobs is not None:
        source = sampler if kl_penalty_source == "sample" else detached
        token_kl = (source - ref_logprobs).detach() * mask
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
    if truncated_importance_sampling:
        per_token = per_token * torch.exp(detached - sampler).clamp(max=truncated_importance_sampling)
    if ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = torch.exp(delta) - delta - 1.0
    else:
        kl = torch.zeros_like(per_token)
    return LossParts(policy=(per_token * mask).sum(), kl=(kl * mask).sum(), clipped=(was_clipped * mask).sum())


def _segment_mean(values: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """Each token's segment's mean of `values` over its masked tokens, broadcast back to the tokens (segments: an
    integer id per token; default: one segment per row)."""
    if segments is None:
        total = (values * mask).sum(dim=-1, keepdim=True)
        return (total / mask.sum(dim=-1, keepdim=True).clamp_min(1.0)).expand_as(values)
    ids = segments.reshape(-1).long()
    count = int(ids.max()) + 1 if ids.numel() else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, ids, (values * mask).reshape(-1))
    tokens = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, ids, mask.reshape(-1))
    return (sums / tokens.clamp_min(1.0))[ids].view_as(values)
