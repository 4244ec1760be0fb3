"""The one GRPO loss and the group advantages, against values computed by hand."""

import math

import pytest
import torch

from art_sky.cluster.training.grpo import group_advantages, grpo_loss_sums


def test_advantages_are_reward_minus_mean_over_population_std():
    # rewards 1,2,3: mean 2, population std sqrt(2/3) = 0.816497
    advantages = group_advantages([1.0, 2.0, 3.0])
    std = math.sqrt(2 / 3)
    assert advantages == pytest.approx([-1 / (std + 1e-6), 0.0, 1 / (std + 1e-6)], abs=1e-9)
    assert advantages[2] == pytest.approx(1.2247434, abs=1e-6)


def test_two_level_rewards_give_unit_advantages():
    assert group_advantages([1.0, -1.0, -1.0, 1.0]) == pytest.approx([0.999999, -0.999999, -0.999999, 0.999999],
                                                                     abs=1e-6)


def test_equal_rewards_teach_nothing():
    assert group_advantages([0.5, 0.5, 0.5]) is None


def _loss(new, old, adv, mask, ref=None, eps=0.2, eps_high=0.2):
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    return grpo_loss_sums(t(new), t(old), torch.tensor([[adv]], dtype=torch.float64), torch.tensor([mask]),
                          epsilon=eps, epsilon_high=eps_high, ref_logprobs=None if ref is None else t(ref))


def test_positive_advantage_is_clipped_above():
    # ratios 2 and 1 with A=1: token 1 takes min(2, 1.2) = 1.2, token 2 takes 1 -> loss -(1.2 + 1) = -2.2
    parts = _loss([math.log(0.5), math.log(0.5)], [math.log(0.25), math.log(0.5)], 1.0, [True, True])
    assert float(parts.policy) == pytest.approx(-2.2)
    assert float(parts.clipped) == 1.0


def test_negative_advantage_keeps_the_pessimistic_term():
    # ratios 2 and 1 with A=-1: min(-2, -1.2) = -2 and -1 -> loss 2 + 1 = 3, nothing clipped
    parts = _loss([math.log(0.5), math.log(0.5)], [math.log(0.25), math.log(0.5)], -1.0, [True, True])
    assert float(parts.policy) == pytest.approx(3.0)
    assert float(parts.clipped) == 0.0


def test_asymmetric_clip_uses_epsilon_high():
    # ratio 2, A=1, eps_high 0.5 -> min(2, 1.5) = 1.5
    parts = _loss([math.log(0.5)], [math.log(0.25)], 1.0, [True], eps_high=0.5)
    assert float(parts.policy) == pytest.approx(-1.5)


def test_masked_tokens_do_not_count():
    parts = _loss([math.log(0.5), math.log(0.1)], [math.log(0.25), math.log(0.9)], 1.0, [True, False])
    assert float(parts.policy) == pytest.approx(-1.2)


def test_missing_old_logprob_means_ratio_one_with_policy_gradient():
    new = torch.tensor([[math.log(0.3)]], dtype=torch.float64, requires_grad=True)
    parts = grpo_loss_sums(new, torch.tensor([[math.nan]], dtype=torch.float64), torch.tensor([[2.0]]),
                           torch.tensor([[True]]), epsilon=0.2, epsilon_high=0.2)
    assert float(parts.policy) == pytest.approx(-2.0)
    parts.policy.backward()
    assert float(new.grad) == pytest.approx(-2.0)  # d/dnew of -A * exp(new - sg(new)) = -A


def test_k3_kl_against_reference():
    # ref 0.5, new 0.25: delta = log 2 -> e^delta - delta - 1 = 2 - 0.693147 - 1 = 0.306853
    parts = _loss([math.log(0.25)], [math.log(0.25)], 0.0, [True], ref=[math.log(0.5)])
    assert float(parts.kl) == pytest.approx(0.3068528, abs=1e-6)
    assert float(parts.policy) == pytest.approx(0.0)


def test_advantages_without_scaling_are_only_centred():
    assert group_advantages([1.0, 2.0, 3.0], scale=False) == [-1.0, 0.0, 1.0]


def test_cispo_weights_the_logprob_by_the_clipped_detached_ratio():
    # ratios 2 and 1, A=1, clip [0, 1.5]: loss = -(1.5 * log 0.5 + 1 * log 0.5) = 2.5 * 0.693147 = 1.732868
    new = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.5)]], dtype=torch.float64)
    parts = grpo_loss_sums(new, old, torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[True, True]]),
                           epsilon=1.0, epsilon_high=0.5, loss_fn="cispo")
    assert float(parts.policy) == pytest.approx(1.7328680, abs=1e-6)
    assert float(parts.clipped) == 1.0
    parts.policy.backward()
    assert new.grad[0].tolist() == pytest.approx([-1.5, -1.0])  # the ratio carries no gradient


def test_kl_penalty_shifts_advantages_towards_the_mean_kl():
    # token KLs (new - ref) 0.2 and 0.0, mean 0.1; coef 1 -> advantages 1 - 0.1 = 0.9 and 1 + 0.1 = 1.1.
    # ratios 1 (old = new): ppo loss = -(0.9 + 1.1) = -2.0, but the gradient weights the tokens 0.9 and 1.1.
    new = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    parts = grpo_loss_sums(new, torch.full((1, 2), math.nan, dtype=torch.float64),
                           torch.tensor([[1.0]], dtype=torch.float64), torch.tensor([[True, True]]),
                           epsilon=0.2, epsilon_high=0.2, ref_logprobs=ref, kl_penalty_coef=1.0)
    assert float(parts.policy) == pytest.approx(-2.0, abs=1e-5)
    parts.policy.backward()
    assert new.grad[0].tolist() == pytest.approx([-0.9, -1.1], abs=1e-5)
