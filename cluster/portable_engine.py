"""The portable inference engine: transformers + the live PEFT adapter, on any device.

It samples with the trainer's own weights, so a finished training step is served at once. Logprobs are the
model's raw log-softmax (temperature 1, before top-p), the same quantity the trainer recomputes.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

import torch
from openai.types.chat import ChatCompletion

from art_sky.wire import ChatCompletionRequest, RegisterRequest

from .engine import Job
from .model_state import ModelState, device
from .sequences import prompt_ids

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str


class PortableEngine:
    """Concurrent requests for the same model are sampled together as one batch (left-padded), one forward pass
    per token for all of them: on a CPU that is most of the speed there is to have."""

    name = "portable"
    inference_port = None  # served by the control server's own /v1 route

    def __init__(self, max_new_tokens_limit: int):
        self.max_new_tokens_limit = max_new_tokens_limit

    # The server's engine hooks: nothing to do, the engine samples with the trainer's live model.
    def check(self, request: RegisterRequest) -> None:
        pass

    def attach(self, state: ModelState) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self, state: ModelState, trained: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def prepare(self, state: ModelState, request: ChatCompletionRequest) -> Job:
        """Render the prompt and check the budget; ValueError (a 400) when the request asks too much."""
        prompt = prompt_ids(state.tokenizer, request.messages, request.tools)
        asked = request.max_completion_tokens or request.max_tokens
        room = state.request.config.max_seq_length - len(prompt)
        if room <= 0:
            raise ValueError(f"the prompt is {len(prompt)} tokens, the model's context is "
                             f"{state.request.config.max_seq_length}: shorten the conversation")
        if asked is not None and asked > self.max_new_tokens_limit:
            raise ValueError(f"max_tokens {asked} exceeds this server's limit {self.max_new_tokens_limit} "
                             "(ART_SKY_MAX_NEW_TOKENS_LIMIT)")
        return Job(state, request, prompt, min(asked or self.max_new_tokens_limit, room))

    def complete(self, state: ModelState, request: ChatCompletionRequest) -> ChatCompletion:
        return self.run([self.prepare(state, request)])[0]

    def run(self, jobs: list[Job]) -> list[ChatCompletion]:
        """Blocking: sample every job (all for one model) in one batch. Run it off the event loop, under the lock."""
        samples = self._sample(jobs)
        return [self._response(job, rows) for job, rows in zip(jobs, samples)]

    @torch.inference_mode()
    def _sample(self, jobs: list[Job]) -> list[list[Sample]]:
        state, dev = jobs[0].state, device()
        rows = [(job, copy) for job in jobs for copy in range(job.request.n)]
        width = max(len(job.prompt) for job in jobs)
        pad = state.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(job.prompt)) + job.prompt for job, _ in rows], device=dev)
        mask = torch.tensor([[0] * (width - len(job.prompt)) + [1] * len(job.prompt) for job, _ in rows],
                            device=dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator(device=dev) for _ in jobs]
        for job, generator in zip(jobs, generators):
            seed = job.request.seed
            generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:6]))
        spans, start = [], 0
        for job in jobs:
            spans.append((start, start + job.request.n))
            start += job.request.n
        out = state.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in rows]
        finish: list[str | None] = [None] * len(rows)
        eos = state.eos_token_ids
        for step in range(max(job.budget for job in jobs)):
            logits = out.logits[:, -1, :].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            chosen = torch.cat([self._choose(logits[a:b], job.request, generator)
                                for job, generator, (a, b) in zip(jobs, generators, spans)])
            for row, (job, _) in enumerate(rows):
                if finish[row] is not None:
                    continue
                token = int(chosen[row])
                tokens[row].append(token)
                logps[row].append(float(logprobs[row, token]))
                if job.request.top_logprobs:
                    values, indices = logprobs[row].topk(job.request.top_logprobs)
                    tops[row].append(list(zip(indices.tolist(), values.tolist())))
                stops = job.request.stop_strings
                if token in eos or (stops and any(s in state.tokenizer.decode(tokens[row]) for s in stops)):
                    finish[row] = "stop"
                elif step + 1 >= job.budget:
                    finish[row] = "length"
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
            positions = positions[:, -1:] + 1
            out = state.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions,
                              past_key_values=out.past_key_values, use_cache=True)
        samples = [Sample(tokens[r], logps[r], tops[r], finish[r] or "length") for r in range(len(rows))]
        return [samples[a:b] for a, b in spans]

    @staticmethod
    def _choose(logits: torch.Tensor, request: ChatCompletionRequest, generator: torch.Generator) -> torch.Tensor:
        if request.temperature == 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / request.temperature, dim=-1)
        if request.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > request.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    def _response(self, job: Job, samples: list[Sample]) -> ChatCompletion:
        request, tokenizer, prompt_len = job.request, job.state.tokenizer, len(job.prompt)
        choices = []
        for index, sample in enumerate(samples):
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            for stop in request.stop_strings:
                if stop in text:
                    text = text[: text.index(stop)]
            message: dict = {"role": "assistant", "content": text}
            finish = sample.finish_reason
            calls = _tool_calls(text) if request.tools else []
            if calls:
                message["content"] = _TOOL_CALL.sub("", text).strip() or None
                message["tool_calls"] = calls
                finish = "tool_calls"
            choice: dict = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
            if request.logprobs:  # the sampled ids too, named as vLLM's `return_token_ids` names them
                choice["token_ids"] = sample.token_ids
                choice["logprobs"] = {"content": [
                    self._token_logprob(tokenizer, token, logprob, request.return_tokens_as_token_ids,
                                        sample.top[i] if sample.top else [])
                    for i, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs))
                ]}
            choices.append(choice)
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return ChatCompletion.model_validate({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": choices,
            **({"prompt_token_ids": job.prompt} if request.logprobs else {}),
            "usage": {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_len + completion_tokens},
        })

    @staticmethod
    def _token_logprob(tokenizer, token: int, logprob: float, as_ids: bool, top: list[tuple[int, float]]) -> dict:
        def entry(t: int, lp: float) -> dict:
            text = tokenizer.decode([t], skip_special_tokens=False)
            return {"token": f"token_id:{t}" if as_ids else text, "logprob": lp, "bytes": list(text.encode())}

        return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}


def _tool_calls(text: str) -> list[dict]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as OpenAI tool calls."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": str(name), "arguments": json.dumps(arguments)}})
    return calls
