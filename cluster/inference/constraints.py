"""Constrained decoding on the portable engine, with llguidance (the grammar library vLLM uses) and vLLM's grammars:
`response_format` json_object / json_schema, `tool_choice` named (the reply is that tool's arguments) and required
(the reply is a JSON list of calls), so both engines answer the same parameters alike. The JSON is compact on both.

The mask changes which token is drawn, never how it is recorded: a sampled token's logprob stays the model's own
log-softmax (the quantity the trainer recomputes), and its id is the id sampled.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from art_sky.wire import ChatCompletionRequest, NamedToolChoice

from .openai_api import OpenAIError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in llguidance's stubs only

# Compact JSON (`,` and `:`, no whitespace between tokens), as OpenAI's structured outputs and vLLM's
# `disable_any_whitespace` (cluster/inference/vllm_engine.py sets it): free whitespace lets a weak model pad a reply
# until max_tokens cuts it, while a schema that bounds its strings, numbers and arrays bounds the whole reply.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class Grammar:
    """What one request's reply must be: `json` (its content), `named` (the arguments of `tool`), `required` (a
    list of {"name", "parameters"} calls)."""

    kind: Literal["json", "named", "required"]
    schema: dict  # the JSON schema (vLLM's own sampler takes this)
    text: str  # llguidance's grammar
    tool: str | None = None


def grammar_for(request: ChatCompletionRequest) -> Grammar | None:
    """The grammar a request asks for, or None; a 400 naming the field whose schema llguidance cannot compile."""
    choice, form = request.tool_choice, request.response_format
    forced = choice == "required" or (choice is not None and not isinstance(choice, str))
    if form is not None and form.type != "text":
        if forced:
            raise OpenAIError(
                400,
                "response_format and a forced tool_choice both constrain the reply: send one",
                param="response_format",
            )
        schema: dict[str, Any]
        if form.type == "json_object":
            schema = {"type": "object"}
        else:
            assert form.json_schema is not None  # ResponseFormat requires it for "json_schema"
            schema = form.json_schema.json_schema
        return Grammar("json", schema, _compiled(schema, "response_format.json_schema.schema"))
    tools = request.tools or []  # a tool_choice without tools is refused before (portable_engine._tools_shown)
    if choice == "required":  # vLLM's schema, a call object holding nothing else
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [tool["function"]["name"]]},
                            "parameters": _parameters(tool),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for tool in tools
                ],
            },
        }
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return Grammar("required", schema, _compiled(schema, "tools"))
    if isinstance(choice, NamedToolChoice):  # forced, and not "required"
        tool = next(t for t in tools if t["function"]["name"] == choice.function.name)
        return Grammar("named", _parameters(tool), _compiled(_parameters(tool), "tools"), tool=choice.function.name)
    return None


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _compiled(schema: Any, field: str) -> str:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise OpenAIError(400, f"{field} is not a JSON schema: {exc}", param=field) from exc
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise OpenAIError(400, f"{field} cannot be compiled into a grammar: {problem}", param=field)
    return grammar


def tool_calls(grammar: Grammar, text: str) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON) calls a forced tool_choice's reply makes, or None for a reply cut short."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if grammar.kind == "named":
        assert grammar.tool is not None  # `grammar_for` names the tool of a named grammar
        return [(grammar.tool, json.dumps(value, ensure_ascii=False))]
    return [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> {vocab size: LLTokenizer}


def _ll_tokenizer(tokenizer: Any, vocab: int, eos: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer (about a second to build for a 150k vocabulary: built once)."""
    built = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab not in built:
        built[vocab] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    return built[vocab]


class Matchers:
    """The grammar state of each sampled row of a batch (None: the row samples freely)."""

    def __init__(self, tokenizer: Any, eos: list[int], vocab: int, grammars: list[Grammar | None]):
        ll = _ll_tokenizer(tokenizer, vocab, eos) if any(grammars) else None
        self.rows = [llguidance.LLMatcher(ll, g.text, log_level=0) if g and ll is not None else None for g in grammars]
        self.active = [row for row, matcher in enumerate(self.rows) if matcher is not None]
        self.vocab, self.eos = vocab, set(eos)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits to draw from: each active constrained row's tokens its grammar forbids at -inf (a copy)."""
        if not self.active:
            return logits
        bitmask = llguidance.torch.allocate_token_bitmask(len(self.active), self.vocab)
        for index, row in enumerate(self.active):
            matcher = self.rows[row]
            assert matcher is not None  # an active row is a constrained one
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, index)
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, : logits.shape[-1]].bool()
        logits = logits.clone()
        rows = torch.tensor(self.active, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def consume(self, row: int, token: int) -> None:
        matcher = self.rows[row]
        if matcher is None or row not in self.active:
            return
        if not matcher.consume_token(token):
            raise RuntimeError(f"constrained sampling drew token {token} its grammar refuses: {matcher.get_error()}")
        if token in self.eos:  # the grammar's end drawn and, with ignore_eos, the row goes on: unconstrained
            self.finish(row)

    def finish(self, row: int) -> None:
        """The row is done: it is no longer masked (a finished grammar allows no token at all)."""
        if row in self.active:
            self.active.remove(row)
