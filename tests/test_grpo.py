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
    assert group_advantages([1.0, -1.0, -1.0, 1.0]) == pytest.approx(
        [0.999999, -0.999999, -0.999999, 0.999999], abs=1e-6
    )


def test_equal_rewards_teach_nothing():
    assert group_advantages([0.5, 0.5, 0.5]) is None


def _loss(new, old, adv, mask, ref=None, eps=0.2, eps_high=0.2):
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    return grpo_loss_sums(
        t(new),
        t(old),
        torch.tensor([[adv]], dtype=torch.float64),
        torch.tensor([mask]),
        epsilon=eps,
        epsilon_high=eps_high,
        ref_logprobs=None if ref is None else t(ref),
    )


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
    parts = grpo_loss_sums(
        new,
        torch.tensor([[math.nan]], dtype=torch.float64),
        torch.tensor([[2.0]]),
        torch.tensor([[True]]),
        epsilon=0.2,
        epsilon_high=0.2,
    )
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
    parts = grpo_loss_sums(
        new,
        old,
        torch.tensor([[1.0]], dtype=torch.float64),
        torch.tensor([[True, True]]),
        epsilon=1.0,
        epsilon_high=0.5,
        loss_fn="cispo",
    )
    assert float(parts.policy) == pytest.approx(1.7328680, abs=1e-6)
    assert float(parts.clipped) == 1.0
    parts.policy.backward()
    assert new.grad[0].tolist() == pytest.approx([-1.5, -1.0])  # the ratio carries no gradient


def test_kl_penalty_shifts_advantages_towards_the_mean_kl():
    # token KLs (new - ref) 0.2 and 0.0, mean 0.1; coef 1 -> advantages 1 - 0.1 = 0.9 and 1 + 0.1 = 1.1.
    # ratios 1 (old = new): ppo loss = -(0.9 + 1.1) = -2.0, but the gradient weights the tokens 0.9 and 1.1.
    new = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    parts = grpo_loss_sums(
        new,
        torch.full((1, 2), math.nan, dtype=torch.float64),
        torch.tensor([[1.0]], dtype=torch.float64),
        torch.tensor([[True, True]]),
        epsilon=0.2,
        epsilon_high=0.2,
        ref_logprobs=ref,
        kl_penalty_coef=1.0,
    )
    assert float(parts.policy) == pytest.approx(-2.0, abs=1e-5)
    parts.policy.backward()
    assert new.grad[0].tolist() == pytest.approx([-0.9, -1.1], abs=1e-5)


# -- ART's variants (art/loss.py), each against a computation written out here -----------------------------------
NEW = [[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]]
OLD = [[-1.2, -1.7, -0.5], [-1.0, math.nan, -2.5]]
MASK = [[True, True, False], [True, True, True]]
ADV = [[1.0], [-0.5]]


def _variant(**settings):
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    parts = grpo_loss_sums(
        new,
        torch.tensor(OLD, dtype=torch.float64),
        torch.tensor(ADV, dtype=torch.float64),
        torch.tensor(MASK),
        **({"epsilon": 0.2, "epsilon_high": 0.2} | settings),
    )
    parts.policy.backward()
    return [float(parts.policy), *new.grad.flatten().tolist()]


def _expected(ratio_of, loss="ppo", eps=0.2, weight_of=lambda r, t: 1.0):
    """sum over trained tokens of the loss, by the formula, token by token; and d(loss)/d(new) numerically."""

    def loss_at(new):
        total = 0.0
        for r, row in enumerate(new):
            for t, value in enumerate(row):
                if not MASK[r][t]:
                    continue
                ratio, adv = ratio_of(new if loss == "ppo" else NEW, r, t), ADV[r][0]  # cispo: ratio detached
                clipped = min(max(ratio, 1 - eps), 1 + eps)
                if loss == "ppo":
                    term = -min(ratio * adv, clipped * adv)
                else:  # cispo: the clipped ratio is a constant weight of the logprob
                    term = -clipped * adv * value
                total += term * weight_of(r, t)
        return total

    value = loss_at(NEW)
    grads = []
    for r, row in enumerate(NEW):
        grads.append([])
        for t in range(len(row)):
            bumped = [list(x) for x in NEW]
            bumped[r][t] += 1e-6
            grads[-1].append((loss_at(bumped) - value) / 1e-6)
    return [value, *(g for row in grads for g in row)]


def _old(r, t, new):
    """The engine's logprob; where it reported none, the new logprob as a constant (ratio 1)."""
    return NEW[r][t] if math.isnan(OLD[r][t]) else OLD[r][t]


def _token_ratio(new, r, t):
    return math.exp(new[r][t] - _old(r, t, new))


def _sequence_ratio(new, r, t):
    tokens = [i for i in range(len(new[r])) if MASK[r][i]]
    return math.exp(sum(new[r][i] - _old(r, i, new) for i in tokens) / len(tokens))


def test_token_level_ratio_matches_the_formula():
    assert _variant() == pytest.approx(_expected(_token_ratio), abs=1e-5)


@pytest.mark.parametrize(
    "level, combine",
    [
        ("sequence", lambda token, sequence: sequence),
        ("average", lambda token, sequence: (token + sequence) / 2),
        ("geometric_average", lambda token, sequence: math.sqrt(token * sequence)),
    ],
)
def test_sequence_level_ratios_match_the_formula(level, combine):
    """GSPO: the exp of the mean log-ratio over the sequence's trained tokens (NaN old logprobs count as new ones)."""
    expected = _expected(lambda new, r, t: combine(_token_ratio(new, r, t), _sequence_ratio(new, r, t)))
    assert _variant(importance_sampling_level=level) == pytest.approx(expected, abs=1e-5)


def test_segments_group_tokens_of_one_sequence_within_a_packed_row():
    """A row packing two sequences: the sequence ratio is each segment's own."""
    new = torch.tensor([[-1.0, -2.0, -0.5, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -2.0, -0.5, -0.0]], dtype=torch.float64)
    segments = torch.tensor([[0, 0, 1, 1]])
    parts = grpo_loss_sums(
        new,
        old,
        torch.tensor([[1.0]], dtype=torch.float64),
        torch.ones(1, 4, dtype=torch.bool),
        epsilon=10.0,
        epsilon_high=10.0,
        importance_sampling_level="sequence",
        segments=segments,
    )
    first, second = math.exp((0.5 + 0.0) / 2), math.exp((0.0 - 1.0) / 2)
    assert float(parts.policy) == pytest.approx(-(2 * first + 2 * second), abs=1e-6)


def test_kl_penalty_from_the_sampler_uses_the_old_logprobs():
    """kl_penalty_source "sample": each token's KL is old - ref (ART's async default), not new - ref."""
    new = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.3]], dtype=torch.float64)
    ref = torch.tensor([[-1.2, -2.0]], dtype=torch.float64)
    parts = grpo_loss_sums(
        new,
        old,
        torch.tensor([[1.0]], dtype=torch.float64),
        torch.tensor([[True, True]]),
        epsilon=10.0,
        epsilon_high=10.0,
        ref_logprobs=ref,
        kl_penalty_coef=1.0,
        kl_penalty_source="sample",
    )
    parts.policy.backward()
    kl = [-1.1 + 1.2, -2.3 + 2.0]  # 0.1, -0.3: mean -0.1
    mean = sum(kl) / 2
    advantages = [1.0 + (mean - k) for k in kl]  # 0.8, 1.2
    ratios = [math.exp(-1.0 + 1.1), math.exp(-2.0 + 2.3)]
    assert float(parts.policy) == pytest.approx(-sum(r * a for r, a in zip(ratios, advantages, strict=False)), abs=1e-6)
    assert new.grad[0].tolist() == pytest.approx([-r * a for r, a in zip(ratios, advantages, strict=False)], abs=1e-6)


def test_truncated_importance_sampling_weights_by_trainer_over_sampler_capped():
    """ART's TIS with the trainer's own old logprobs: ratio 1 against them, each token's loss times
    min(exp(trainer - sampler), cap)."""
    cap = 1.1
    weight = lambda r, t: min(math.exp(NEW[r][t] - _old(r, t, NEW)), cap)  # noqa: E731
    expected = _expected(lambda new, r, t: math.exp(new[r][t] - NEW[r][t]), weight_of=weight)
    assert _variant(truncated_importance_sampling=cap) == pytest.approx(expected, abs=1e-5)


def test_trainer_old_logprobs_make_the_ratio_one_with_the_policy_gradient():
    """ART's precalculate_logprobs: the old policy is the trainer's at the step's start, so the loss is the plain
    policy gradient whatever the sampler reported."""
    expected = _expected(lambda new, r, t: math.exp(new[r][t] - NEW[r][t]))
    assert _variant(old_policy="trainer") == pytest.approx(expected, abs=1e-5)


def test_cispo_with_sequence_ratios_matches_the_formula():
    expected = _expected(_sequence_ratio, loss="cispo", eps=0.5)
    assert _variant(
        loss_fn="cispo", epsilon=0.5, epsilon_high=0.5, importance_sampling_level="sequence"
    ) == pytest.approx(expected, abs=1e-5)
