"""The portable inference engine: transformers + PEFT, on any device.

It samples with the trainer's base weights and its own copy of the LoRA (`_serving_copy`: the frozen base tensors
shared, so the copy costs the adapter's size), so inference goes on while a step trains the trainer's LoRA; the
step's end copies the new weights in. An older step (`name@step`) is its checkpoint's LoRA loaded beside the
served one as a second PEFT adapter. Logprobs are the model's raw log-softmax (temperature 1, before top-p), the
same quantity the trainer recomputes.

Concurrent requests for the same model are sampled together as one batch (left-padded), one forward pass per
token for all of them: on a CPU that is most of the speed there is to have. A streaming request gets each token
as it is sampled; a client that goes away only drops its rows, the batch goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from openai.types.chat import ChatCompletion
from pydantic import ValidationError

from art_sky.errors import TokenizationError
from art_sky.wire import ChatCompletionRequest, RegisterRequest

from ..chat_template import prompt_ids
from ..model_state import ADAPTER, ModelState, device
from .chat_parameters import PORTABLE
from .constraints import Grammar, Matchers, grammar_for, tool_calls
from .gate import Hold
from .openai_api import SSE, OpenAIError, Served, invalid_request, sse
from .reasoning_parsers import PARSERS as REASONING_PARSERS
from .reasoning_parsers import ReasoningParser
from .tool_parsers import ToolParser, portable_parser

log = logging.getLogger("art_sky.cluster")


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str


@dataclass
class Job:
    """One validated chat completion request: its prompt ids, its completion budget, the step that serves it."""

    state: ModelState
    request: ChatCompletionRequest
    prompt: list[int]
    budget: int
    step: int | None = None  # an older step than the live one: its checkpoint's adapter samples
    tools: list[dict] | None = None  # the tools the prompt shows (tool_choice none: none; named: that one)
    grammar: Grammar | None = None  # what the reply must be (response_format, a forced tool_choice)
    parser: ToolParser | None = None  # how tool calls are read from the reply (its chat template's family)
    reasoning: ReasoningParser | None = None  # how the reply's reasoning is split from its content (the model's)
    stream: _Events | None = None  # stream=True: sampled tokens go out as they come
    cancelled: bool = False  # the streaming client went away: its rows stop

    @property
    def parses_tools(self) -> bool:
        """Tool calls are read from the reply's text (a forced tool_choice's reply is its calls' JSON instead)."""
        return bool(self.tools) and self.parser is not None and self.grammar is None

    @property
    def forced_call(self) -> bool:
        return self.grammar is not None and self.grammar.kind != "json"


class PortableEngine:
    name = "portable"
    engine_port = None  # no port of its own: it samples inside the server
    honoured = PORTABLE
    serves_while_training = True  # from its own copy of each adapter (a model it cannot copy turns this off)

    def __init__(
        self, max_new_tokens_limit: int, max_batch_rows: int = 64, max_loaded_steps: int = 4, tool_parser: str = ""
    ):
        portable_parser(tool_parser, None)  # a parser this engine lacks is refused at start, naming the setting
        self.tool_parser = tool_parser
        self.max_new_tokens_limit = max_new_tokens_limit
        self.max_batch_rows = max_batch_rows
        self._queue: _BatchQueue | None = None
        self.max_older = max(1, max_loaded_steps - 1)  # older steps loaded beside each model's served adapter
        self._older: OrderedDict[tuple[int, int], tuple[ModelState, str]] = OrderedDict()  # -> PEFT adapter
        self._serving: dict[int, Any] = {}  # id(state) -> the model it samples with

    def check(self, request: RegisterRequest) -> None:
        pass

    def attach(self, state: ModelState) -> None:
        """Serve a newly registered model from a copy of its adapter, or from the trainer's model (pausing for
        steps) where the model cannot be copied."""
        try:
            self._serving[id(state)] = _serving_copy(state.model)
        except Exception as exc:  # a trainer's model that deepcopy cannot take (patched modules)
            log.warning(
                "portable engine: %s cannot be copied for serving (%s): inference pauses while it trains",
                state.name,
                exc,
            )
            self._serving[id(state)] = state.model
            self.serves_while_training = False

    def pause(self) -> None:
        pass

    def resume(self, state: ModelState, trained: bool) -> None:
        """The new step's weights into the serving copy. No batch runs: the device gate is held alone."""
        serving = self._serving[id(state)]
        if trained and serving is not state.model:
            served = dict(serving.named_parameters())
            with torch.no_grad():
                for name, param in state.model.named_parameters():
                    if param.requires_grad:
                        served[name].copy_(param)

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    # -- the OpenAI route ----------------------------------------------------------------------------------------

    async def chat(self, served: Served, body: dict, hold: Hold) -> bytes | SSE:
        """Sample one request in the next batch; `hold` (its share of the device gate) ends with its sampling."""
        try:
            request = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise invalid_request(exc) from exc
        job = await asyncio.to_thread(  # the chat template and the tokenizer: off the event loop
            self.prepare, served.state, request, None if served.step == served.state.step else served.step
        )
        if self._queue is None:
            self._queue = _BatchQueue(self)
        queue = self._queue
        if request.stream:
            job.stream = _Events(asyncio.get_running_loop())
        done = queue.submit(job)
        done.add_done_callback(lambda _: hold.release())  # once the job has left the sampler, never before
        if not request.stream:
            completion = await asyncio.shield(done)
            return json.dumps(served.label(completion) | {"model": served.name}).encode()

        async def close() -> None:
            job.cancelled = True  # the sampler drops this job's rows at its next token
            queue.withdraw(job)

        return SSE(_StreamWriter(job, served.name, served.step).chunks(done), close)

    # -- sampling ------------------------------------------------------------------------------------------------

    def prepare(self, state: ModelState, request: ChatCompletionRequest, step: int | None = None) -> Job:
        """Render the prompt and check the request; ValueError (a 400) when it asks what this engine cannot do."""
        tools = _tools_shown(request)
        grammar = grammar_for(request)
        try:
            prompt = prompt_ids(state.tokenizer, request.message_dicts(), tools, request.chat_template_kwargs)
        except TokenizationError as exc:
            raise OpenAIError(
                400, str(exc), param="chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "messages"
            ) from exc
        except Exception as exc:  # the model's own template code: whatever it raises means "cannot render this"
            raise OpenAIError(
                400, f"the model's chat template cannot render these messages: {exc!r}", param="messages"
            ) from exc
        asked = request.max_completion_tokens or request.max_tokens
        room = state.request.config.max_seq_length - len(prompt)
        if room <= 0:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens, the model's context is "
                f"{state.request.config.max_seq_length}: shorten the conversation"
            )
        if asked is not None and asked > self.max_new_tokens_limit:
            raise ValueError(
                f"max_tokens {asked} exceeds this server's limit {self.max_new_tokens_limit} "
                "(ART_SKY_MAX_NEW_TOKENS_LIMIT)"
            )
        return Job(
            state,
            request,
            prompt,
            min(asked or self.max_new_tokens_limit, room),
            step=step,
            tools=tools,
            grammar=grammar,
            parser=portable_parser(self.tool_parser, state.tokenizer.chat_template),
            reasoning=REASONING_PARSERS.get(state.request.config.reasoning_parser or ""),
        )

    def complete(self, state: ModelState, request: ChatCompletionRequest) -> ChatCompletion:
        return ChatCompletion.model_validate(self.run([self.prepare(state, request)])[0])

    def run(self, jobs: list[Job]) -> list[dict | None | OpenAIError]:
        """Blocking: sample every job (all for one model) in one batch. Run it off the event loop, under the gate.
        A non-streaming job gets its response; a streaming one got its tokens already (None)."""
        results: list[dict | None | OpenAIError] = []
        for job, rows in zip(jobs, self._sample(jobs), strict=False):
            try:
                results.append(None if job.stream else _response(job, rows))
            except OpenAIError as exc:  # this request's answer is refused (tool_choice), not the batch's
                results.append(exc)
        return results

    def _adapters(self, jobs: list[Job]) -> list[str] | None:
        """The PEFT adapter of each job: the served one, or an older step's checkpoint loaded beside it (at most
        max_loaded_steps - 1 older steps at once, least recently used unloaded first, never one this batch uses)."""
        if all(job.step is None for job in jobs):
            return None
        needed = {(id(job.state), job.step) for job in jobs if job.step is not None}
        for job in jobs:
            if job.step is None:
                continue
            key = (id(job.state), job.step)
            if key in self._older:
                continue
            name = f"step-{job.step}"
            self._model(job.state).load_adapter(str(job.state.checkpoints.step_dir(job.step)), adapter_name=name)
            self._older[key] = (job.state, name)
            log.info("portable engine loaded step %d of %s", job.step, job.state.name)
            for old in [k for k in self._older if k not in needed][: max(0, len(self._older) - self.max_older)]:
                state, evicted = self._older.pop(old)
                self._model(state).delete_adapter(evicted)
        for key in needed:
            self._older.move_to_end(key)
        return [ADAPTER if job.step is None else self._older[(id(job.state), job.step)][1] for job in jobs]

    def _model(self, state: ModelState) -> Any:
        """The model a registered model's completions are sampled with."""
        return self._serving[id(state)]

    @torch.inference_mode()
    def _sample(self, jobs: list[Job]) -> list[list[Sample]]:
        state, dev = jobs[0].state, device()
        model = self._model(state)
        rows = [(job, copy) for job in jobs for copy in range(job.request.n)]
        adapters = self._adapters(jobs)
        extra = (
            {}
            if adapters is None
            else {
                "adapter_names": [name for job, name in zip(jobs, adapters, strict=False) for _ in range(job.request.n)]
            }
        )
        width = max(len(job.prompt) for job in jobs)
        pad = state.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(job.prompt)) + job.prompt for job, _ in rows], device=dev)
        mask = torch.tensor([[0] * (width - len(job.prompt)) + [1] * len(job.prompt) for job, _ in rows], device=dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator(device=dev) for _ in jobs]
        for job, generator in zip(jobs, generators, strict=False):
            seed = job.request.seed
            generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:6]))
        spans, start = [], 0
        for job in jobs:
            spans.append((start, start + job.request.n))
            start += job.request.n
        texts = [_Detokenizer(state.tokenizer) if job.stream or job.request.stop_strings else None for job, _ in rows]
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        matchers = Matchers(
            state.tokenizer, sorted(state.eos_token_ids), out.logits.shape[-1], [job.grammar for job, _ in rows]
        )
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in rows]
        finish: list[str | None] = [None] * len(rows)
        eos = state.eos_token_ids
        for step in range(max(job.budget for job in jobs)):
            logits = out.logits[:, -1, :].float()
            logprobs = torch.log_softmax(logits, dim=-1)  # recorded unmasked: the model's own, as the trainer's
            drawn = matchers.masked(logits)
            chosen = torch.cat(
                [
                    _choose(drawn[a:b], job.request, generator)
                    for job, generator, (a, b) in zip(jobs, generators, spans, strict=False)
                ]
            )
            events: dict[int, list] = {}
            for row, (job, copy) in enumerate(rows):
                if finish[row] is not None:
                    continue
                if job.cancelled:
                    finish[row] = "cancelled"
                    continue
                token = int(chosen[row])
                matchers.consume(row, token)
                tokens[row].append(token)
                logps[row].append(float(logprobs[row, token]))
                if job.request.top_logprobs:
                    values, indices = logprobs[row].topk(job.request.top_logprobs)
                    tops[row].append(list(zip(indices.tolist(), values.tolist(), strict=False)))
                text = texts[row]  # kept where the job streams or has stop strings
                delta = text.add(token) if text else ""
                stops = job.request.stop_strings
                if (token in eos and not job.request.ignore_eos) or (
                    stops and text is not None and any(s in text.text for s in stops)
                ):
                    finish[row] = "stop"
                elif step + 1 >= job.budget:
                    finish[row] = "length"
                if finish[row] is not None:
                    matchers.finish(row)
                if job.stream:
                    events.setdefault(id(job), []).append(
                        (copy, token, logps[row][-1], tops[row][-1] if tops[row] else [], delta, finish[row])
                    )
            for job in jobs:
                if job.stream is not None and id(job) in events:
                    job.stream.put(events[id(job)])
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
                **extra,
            )
        samples = [Sample(tokens[r], logps[r], tops[r], finish[r] or "length") for r in range(len(rows))]
        return [samples[a:b] for a, b in spans]


def _serving_copy(model: Any) -> Any:
    """The model with its own copy of the trainable (LoRA) tensors and every frozen base tensor shared: the
    trainer updates its LoRA while this one samples with the step it was given."""
    shared = {id(param): param for param in model.parameters() if not param.requires_grad}
    serving = deepcopy(model, shared)
    return serving.eval()


def _choose(logits: torch.Tensor, request: ChatCompletionRequest, generator: torch.Generator) -> torch.Tensor:
    if request.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / request.temperature
    if request.top_k and request.top_k > 0:
        kth = logits.topk(min(request.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if request.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > request.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _tools_shown(request: ChatCompletionRequest) -> list[dict] | None:
    """The tools the chat template shows the model: none for tool_choice "none", only the named one when named."""
    choice = request.tool_choice
    if choice is None:
        return request.tools
    if not request.tools:
        raise OpenAIError(
            400, "tool_choice is set but the request has no tools: add tools or drop tool_choice", param="tool_choice"
        )
    if choice == "none":
        return None
    if not isinstance(choice, str):
        named = [t for t in request.tools if t.get("function", {}).get("name") == choice.function.name]
        if not named:
            raise OpenAIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not among the request's tools",
                param="tool_choice",
            )
        return named
    return request.tools


def _content_and_calls(job: Job, text: str) -> tuple[str | None, list[dict]]:
    """The reply's content and its OpenAI tool calls: a forced tool_choice's reply is its calls' JSON (vLLM's way,
    content ""); otherwise the template family's parser reads them from the text. parallel_tool_calls=false keeps
    the first call, as vLLM does. A forced reply cut short by max_tokens is a 422 saying so."""
    content: str | None
    if job.forced_call:
        assert job.grammar is not None  # a forced call's grammar
        calls = tool_calls(job.grammar, text)
        if calls is None:
            raise OpenAIError(
                422,
                "the reply to tool_choice was cut at max_tokens before its call's JSON ended "
                f"({text[:200]!r}): raise max_tokens",
                param="max_tokens",
                type="model_output_error",
            )
        content = ""
    elif job.parses_tools:
        assert job.parser is not None  # it parses tools with its parser
        content, calls = job.parser.parse(text)
    else:
        return text, []
    if job.request.parallel_tool_calls is False:
        calls = calls[:1]
    return content, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]


def _final_text(job: Job, sample: Sample) -> str:
    """The reply's text; with the special tokens a family's tool calls are marked by (Mistral's [TOOL_CALLS])."""
    keep = job.parses_tools and job.parser is not None and job.parser.keeps_special_tokens
    ids = [t for t in sample.token_ids if t not in job.state.eos_token_ids] if keep else sample.token_ids
    text = job.state.tokenizer.decode(ids, skip_special_tokens=not keep)
    for stop in job.request.stop_strings:
        if stop in text:
            text = text[: text.index(stop)]
    return text


def _reasoning_split(job: Job, text: str) -> tuple[str | None, str]:
    """The reply's reasoning (None without a reasoning parser) and the text its content and tool calls come from.
    vLLM's field names, both: `reasoning_content` (what the OpenAI SDK, LangChain and litellm read) and
    `reasoning` (vLLM 0.32's)."""
    if job.reasoning is None:
        return None, text
    reasoning, content = job.reasoning.split(text, job.request.chat_template_kwargs or {})
    return reasoning, content or ""


def _response(job: Job, samples: list[Sample]) -> dict:
    """The chat completion, with the prompt and sampled token ids the trainer needs (vLLM's names)."""
    request, prompt_len = job.request, len(job.prompt)
    choices = []
    for index, sample in enumerate(samples):
        reasoning, text = _reasoning_split(job, _final_text(job, sample))
        content, calls = _content_and_calls(job, text)
        message: dict = {"role": "assistant", "content": content}
        if job.reasoning is not None:
            message |= {"content": content or None, "reasoning_content": reasoning, "reasoning": reasoning}
        finish = sample.finish_reason
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls"
        choice: dict = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
        if request.wants_token_ids:  # vLLM's fields, and the prompt on each choice: a Choice carries its context
            choice |= {"token_ids": sample.token_ids, "prompt_token_ids": job.prompt}
        if request.logprobs:
            choice["logprobs"] = {
                "content": [
                    _token_logprob(job, token, logprob, sample.top[i] if sample.top else [])
                    for i, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs, strict=False))
                ]
            }
        choices.append(choice)
    completion_tokens = sum(len(s.token_ids) for s in samples)
    completion = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens,
        },
    }
    return completion | ({"prompt_token_ids": job.prompt} if request.wants_token_ids else {})


def _token_logprob(job: Job, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
    tokenizer, as_ids = job.state.tokenizer, job.request.return_tokens_as_token_ids

    def entry(t: int, lp: float) -> dict:
        text = tokenizer.decode([t], skip_special_tokens=False)
        return {"token": f"token_id:{t}" if as_ids else text, "logprob": lp, "bytes": list(text.encode())}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}


class _Detokenizer:
    """Text of a growing token list, one delta per token (held back while a character is incomplete)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read, self.text = tokenizer, [], 0, 0, ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self.text += after[len(before) :]
        return after[len(before) :]


class _Events:
    """Sampled tokens from the sampler thread to the request's stream on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[list] = asyncio.Queue()

    def put(self, events: list) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, events)


class _StreamWriter:
    """One streaming job's server-sent events, in OpenAI's chunk format with vLLM's token id fields and, on each
    choice, the step of the adapter that sampled it (`art_sky_step`)."""

    def __init__(self, job: Job, model: str, step: int):
        self.job, self.model, self.step = job, model, step
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        n = job.request.n
        self.sent = [""] * n  # content already sent per choice
        self.thought = [""] * n  # reasoning already sent per choice
        self.text = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n
        parser = job.parser if job.parses_tools else None
        self.marker = parser.marker if parser is not None else None  # a tool call may start here
        self.holds = [s for s in job.request.stop_strings] + ([self.marker] if self.marker else [])

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": choices,
                **extra,
            }
        )

    async def chunks(self, done: asyncio.Future) -> AsyncIterator[bytes]:
        job, stream = self.job, self.job.stream
        assert stream is not None  # a streaming job's writer
        first = {"prompt_token_ids": job.prompt} if job.request.wants_token_ids else {}
        yield self._chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(job.request.n)
            ],
            **first,
        )
        while not all(self.finished):
            if done.done():  # every event of a finished batch is queued before its future resolves
                events = [] if stream.queue.empty() else stream.queue.get_nowait()
                if not events:
                    if not done.cancelled() and (error := done.exception()) is not None:
                        yield sse({"error": _error_body(error)})
                    return
            else:
                getter = asyncio.ensure_future(stream.queue.get())
                await asyncio.wait([getter, done], return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                events = getter.result()
            for event in events:
                for piece in self._token(*event):
                    yield piece
        if job.request.stream_options is not None and job.request.stream_options.include_usage:
            completion = sum(len(t) for t in self.tokens)
            yield self._chunk(
                [],
                usage={
                    "prompt_tokens": len(job.prompt),
                    "completion_tokens": completion,
                    "total_tokens": len(job.prompt) + completion,
                },
            )
        yield b"data: [DONE]\n\n"

    def _token(self, index: int, token: int, logprob: float, top: list, delta: str, finish: str | None):
        job = self.job
        self.tokens[index].append(token)
        self.text[index] += delta
        choice: dict = {"index": index, "delta": {}, "logprobs": None, "finish_reason": None, "art_sky_step": self.step}
        if job.request.wants_token_ids:
            choice["token_ids"] = [token]
        if job.request.logprobs:
            choice["logprobs"] = {"content": [_token_logprob(job, token, logprob, top)]}
        if finish is None:
            if job.reasoning is None:
                choice["delta"]["content"] = self._releasable(index, self.text[index])
            else:
                thought, text = job.reasoning.partial(self.text[index], job.request.chat_template_kwargs or {})
                choice["delta"] = self._thinking(index, thought)
                if (released := self._releasable(index, text)) or not choice["delta"]:
                    choice["delta"]["content"] = released
            yield self._chunk([choice])
            return
        self.finished[index] = True
        sample = Sample(self.tokens[index], [], [], finish)
        try:
            reasoning, text = _reasoning_split(job, _final_text(job, sample))
            content, calls = _content_and_calls(job, text)
        except OpenAIError as exc:
            yield self._chunk([choice | {"delta": {"content": ""}}])
            yield sse({"error": _error_body(exc)})
            self.finished = [True] * len(self.finished)
            return
        rest = (content or "")[len(self.sent[index]) :] if (content or "").startswith(self.sent[index]) else ""
        if job.reasoning is not None:
            choice["delta"] = self._thinking(index, reasoning or "")
        choice["delta"]["content"] = rest
        if calls:
            choice["delta"]["tool_calls"] = [call | {"index": i} for i, call in enumerate(calls)]
            finish = "tool_calls"
        choice["finish_reason"] = finish
        yield self._chunk([choice])

    def _thinking(self, index: int, reasoning: str) -> dict:
        """The delta of the reasoning sent so far (vLLM's two names), or {} when there is none new."""
        if not reasoning.startswith(self.thought[index]) or len(reasoning) <= len(self.thought[index]):
            return {}
        new, self.thought[index] = reasoning[len(self.thought[index]) :], reasoning
        return {"reasoning_content": new, "reasoning": new}

    def _releasable(self, index: int, text: str) -> str:
        """New content that can no longer turn into a stop string or a tool call (none for a forced tool_choice,
        whose reply is its calls)."""
        if self.job.forced_call:
            return ""
        if self.marker and self.marker in text:
            text = text[: text.index(self.marker)]
        for hold in self.holds:
            for size in range(min(len(hold) - 1, len(text)), 0, -1):
                if text.endswith(hold[:size]):
                    text = text[:-size]
                    break
        if not text.startswith(self.sent[index]) or len(text) <= len(self.sent[index]):
            return ""
        new, self.sent[index] = text[len(self.sent[index]) :], text
        return new


def _error_body(exc: BaseException) -> dict:
    if isinstance(exc, OpenAIError):
        return exc.body()
    return {"message": f"sampling failed: {exc}", "type": "server_error", "param": None, "code": 500}


@dataclass
class _BatchQueue:
    """Collects completion requests that arrive together so the engine samples them as one batch.

    Each request holds its share of the device gate until it is sampled: requests wait while a model trains, and
    when training ends they go out in one batch.
    """

    engine: PortableEngine
    pending: list[tuple[Job, asyncio.Future]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    worker: asyncio.Task | None = None

    def submit(self, job: Job) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((job, future))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._work())
        self.wake.set()
        return future

    async def _work(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.pending:
                await asyncio.sleep(0.005)  # let requests sent together join this batch
                batch = self._take()
                if not batch:
                    continue
                results: Sequence[dict | Exception | None]  # an OpenAIError is a request's refusal
                try:
                    results = await asyncio.to_thread(self.engine.run, [job for job, _ in batch])
                except Exception as exc:  # one bad batch fails its requests, not the server
                    log.exception("inference failed")
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results, strict=False):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)

    def withdraw(self, job: Job) -> None:
        """A job whose client went away before its batch started is dropped (one in a batch stops at its next
        token, and its future resolves when the batch ends)."""
        for pending in self.pending:
            if pending[0] is job:
                self.pending.remove(pending)
                pending[1].cancel()
                return

    def _take(self) -> list[tuple[Job, asyncio.Future]]:
        """The oldest request and those after it for the same model, up to max_batch_rows sampled rows."""
        self.pending = [(job, future) for job, future in self.pending if not future.done()]
        if not self.pending:
            return []
        state = self.pending[0][0].state
        batch: list[tuple[Job, asyncio.Future]] = []
        rest: list[tuple[Job, asyncio.Future]] = []
        rows = 0
        for job, future in self.pending:
            if job.state is state and (not batch or rows + job.request.n <= self.engine.max_batch_rows):
                batch.append((job, future))
                rows += job.request.n
            else:
                rest.append((job, future))
        self.pending = rest
        return batch
