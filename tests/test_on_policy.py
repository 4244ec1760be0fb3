"""The engine's reported logprobs equal the trainer's recomputed ones (its packed forward and fused LM head) on the
exact sampled ids (ratio 1)."""

import math

import torch
from openai.types.chat import ChatCompletion

from art_sky.client.trajectories import wire_trajectory
from art_sky.cluster.inference.portable_engine import PortableEngine
from art_sky.cluster.model_state import create_model_state, ensure_optimizer
from art_sky.cluster.training.peft_trainer import PeftTrainer, Policy, pad_id
from art_sky.cluster.training.sequences import build_sequences
from art_sky.settings import Settings
from art_sky.wire import ChatCompletionRequest, RegisterRequest


def test_sampled_logprobs_match_the_trainer(tmp_path):
    state = create_model_state(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), tmp_path, Settings())
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
    request = ChatCompletionRequest(model="m", messages=messages, n=4, max_tokens=10, logprobs=True, seed=3)
    engine = PortableEngine(64)
    engine.attach(state)  # as the server does at registration
    completion = engine.complete(state, request)
    trainer = PeftTrainer(8192)
    policy = Policy(state.model, ensure_optimizer(state), pad_id(state.tokenizer))
    for choice in completion.choices:
        reported = [t.logprob for t in choice.logprobs.content]
        built = build_sequences(
            state.tokenizer,
            wire_trajectory({"messages_and_choices": [*messages, choice], "reward": 0}),
            8192,
            300,
            state.eos_token_ids,
        )
        [seq] = built.sequences
        assert seq.token_ids == choice.prompt_token_ids + choice.token_ids  # the engine's own ids, end to end
        with torch.no_grad():
            recomputed, _ = trainer._scores(policy, trainer._layout(policy, [seq]))
        trained = [recomputed[0, i - 1].item() for i, t in enumerate(seq.trained) if t]
        assert len(trained) == len(reported) == built.exact_tokens
        assert max(abs(a - b) for a, b in zip(trained, reported, strict=False)) < 1e-4
        assert all(not math.isnan(lp) for lp in reported)


def test_batched_requests_sample_as_they_would_alone(tmp_path):
    """Left-padded batching must not change what a request gets: same seed, same tokens and logprobs."""
    state = create_model_state(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), tmp_path, Settings())
    engine = PortableEngine(64)
    engine.attach(state)
    short = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=6,
        logprobs=True,
        return_tokens_as_token_ids=True,
        seed=5,
    )
    long = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "a much longer question " * 3}],
        n=1,
        max_tokens=9,
        logprobs=True,
        return_tokens_as_token_ids=True,
        seed=6,
        temperature=0.7,
        top_p=0.9,
    )
    alone = [engine.complete(state, short), engine.complete(state, long)]
    together = [
        ChatCompletion.model_validate(c)
        for c in engine.run([engine.prepare(state, short), engine.prepare(state, long)])
    ]
    for a, b in zip(alone, together, strict=False):
        for ca, cb in zip(a.choices, b.choices, strict=False):
            assert [t.token for t in ca.logprobs.content] == [t.token for t in cb.logprobs.content]
            assert (
                max(abs(x.logprob - y.logprob) for x, y in zip(ca.logprobs.content, cb.logprobs.content, strict=False))
                < 1e-4
            )
            assert ca.finish_reason == cb.finish_reason


def test_packed_microbatches_train_as_one_row_at_a_time(tmp_path):
    """Rows of different lengths and prompts packed into one pass (no padding, attention within each row, the LM head
    only at trained positions) give the step that one row per pass gives: same loss, KL, clip fraction and update."""
    import copy
    import random

    from art_sky.cluster.training.peft_trainer import PeftTrainer
    from art_sky.cluster.training.sequences import Sequence
    from art_sky.wire import TrainConfig

    state = create_model_state(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), tmp_path, Settings())
    rng = random.Random(0)
    batch = []
    for length, prompt in ((40, 30), (25, 5), (33, 20), (12, 3)):
        ids = [rng.randrange(3, 250) for _ in range(length)]
        trained = [False] * prompt + [rng.random() < 0.8 for _ in range(length - prompt)]
        trained[prompt] = True
        old = [-rng.uniform(4, 7) if t else math.nan for t in trained]
        batch.append(Sequence(ids, trained, old, rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 1.5)))
    config = TrainConfig(learning_rate=1e-3, beta=0.1, epsilon=0.1)
    results = []
    for microbatch_tokens in (200, 1):  # all four in one packed pass; one row per pass
        run = copy.copy(state)
        run.model, run.optimizer = copy.deepcopy(state.model), None
        metrics = PeftTrainer(microbatch_tokens).train(run, batch, config)
        lora = torch.cat([p.detach().flatten() for n, p in run.model.named_parameters() if "lora_" in n])
        results.append((metrics, lora))
    (packed, packed_lora), (alone, alone_lora) = results
    assert packed["clip_fraction"] == alone["clip_fraction"] > 0
    for key in ("loss", "policy_loss", "kl", "grad_norm"):
        assert abs(packed[key] - alone[key]) < 1e-5 * max(1.0, abs(alone[key])), key
    assert torch.allclose(packed_lora, alone_lora, atol=1e-6)
