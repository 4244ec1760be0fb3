"""The engine's reported logprobs equal the trainer's recomputed ones on the exact sampled ids (ratio 1)."""

import math

import torch

from openai.types.chat import ChatCompletion

from art_sky.cluster.model_state import create_model_state
from art_sky.cluster.peft_trainer import _token_logprobs
from art_sky.cluster.portable_engine import PortableEngine
from art_sky.cluster.sequences import tokenize_trajectory
from art_sky.settings import Settings
from art_sky.wire import ChatCompletionRequest, RegisterRequest, WireChoice, WireMessage, WireTrajectory


def test_sampled_logprobs_match_the_trainer(tmp_path):
    state = create_model_state(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), tmp_path,
                               Settings())
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
    request = ChatCompletionRequest(model="m", messages=messages, n=4, max_tokens=10, logprobs=True,
                                    return_tokens_as_token_ids=True, seed=3)
    completion = PortableEngine(64).complete(state, request)
    for choice in completion.choices:
        ids = [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
        reported = [t.logprob for t in choice.logprobs.content]
        trajectory = WireTrajectory(items=[*(WireMessage(**m) for m in messages),
                                           WireChoice(content=choice.message.content, token_ids=ids,
                                                      logprobs=reported)], reward=0)
        seq = tokenize_trajectory(state.tokenizer, trajectory, 1.0, 8192)
        with torch.no_grad():
            logits = state.model(input_ids=torch.tensor([seq.token_ids])).logits
        recomputed = _token_logprobs(logits, torch.tensor([seq.token_ids]))[0]
        trained = [recomputed[i - 1].item() for i, t in enumerate(seq.trained) if t]
        assert len(trained) == len(reported)
        assert max(abs(a - b) for a, b in zip(trained, reported)) < 1e-4
        assert all(not math.isnan(lp) for lp in reported)


def test_batched_requests_sample_as_they_would_alone(tmp_path):
    """Left-padded batching must not change what a request gets: same seed, same tokens and logprobs."""
    state = create_model_state(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), tmp_path,
                               Settings())
    engine = PortableEngine(64)
    short = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
                                  logprobs=True, return_tokens_as_token_ids=True, seed=5)
    long = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "a much longer question " * 3}],
                                 n=1, max_tokens=9, logprobs=True, return_tokens_as_token_ids=True, seed=6,
                                 temperature=0.7, top_p=0.9)
    alone = [engine.complete(state, short), engine.complete(state, long)]
    together = [ChatCompletion.model_validate(c)
                for c in engine.run([engine.prepare(state, short), engine.prepare(state, long)])]
    for a, b in zip(alone, together):
        for ca, cb in zip(a.choices, b.choices):
            assert [t.token for t in ca.logprobs.content] == [t.token for t in cb.logprobs.content]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(ca.logprobs.content, cb.logprobs.content)) < 1e-4
            assert ca.finish_reason == cb.finish_reason
