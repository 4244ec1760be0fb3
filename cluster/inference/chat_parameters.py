"""Which chat completion parameters each engine honours. Any other parameter is a 400 naming it, never ignored:
a structured-output helper that silently gets free text, or a penalty that silently does nothing, is a bug the
user cannot see.

Three kinds of parameters are accepted without an engine acting on them, because they never change what is
sampled: bookkeeping of OpenAI's own service (IGNORED), an explicit null (the parameter is not given), and a
parameter set to the value that asks for nothing (NO_OP: a zero penalty, an empty logit_bias, text output).
"""

from __future__ import annotations

from typing import Any

# Every parameter of OpenAI's chat completion API (openai SDK's CompletionCreateParams, and `stream`).
OPENAI = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)

# Accepted by every engine and not forwarded: who sent the request, OpenAI's storage, billing tier and prompt
# cache routing. None of them changes a sampled token.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
    }
)

# Vendor extensions some clients always send, with the keys that change nothing here: NVIDIA Dynamo's `nvext`
# (ART 0.5.21+ asks for `extra_fields: ["engine_data"]`, response fields art-sky does not add, and may carry
# `annotations`, labels for Dynamo's tracing). They are accepted and not forwarded; any other key of theirs (a
# sampling option: `nvext.top_k`, `nvext.ignore_eos`, ...) is refused by name.
VENDOR: dict[str, frozenset[str]] = {"nvext": frozenset({"extra_fields", "annotations"})}

# Values that ask for nothing, so an engine that does not implement the parameter honours them trivially
# (LangChain and others send some of these by default).
NO_OP: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "parallel_tool_calls": True,
    "response_format": {"type": "text"},
    "modalities": ["text"],
}

# The portable engine (cluster/inference/portable_engine.py): OpenAI's sampling parameters, tools, streaming and the
# vLLM extras ART's client sends (return_tokens_as_token_ids, return_token_ids, chat_template_kwargs) or benchmarks
# use (ignore_eos, top_k).
PORTABLE = frozenset(
    {
        "model",
        "messages",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "stream",
        "stream_options",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "ignore_eos",
        "top_k",
        "chat_template_kwargs",
        "response_format",
        "parallel_tool_calls",  # constrained with llguidance (cluster/inference/constraints.py)
    }
)


def refused(body: dict[str, Any], honoured: frozenset[str] | set[str], engine: str) -> str | None:
    """A message naming every parameter of `body` that `engine` would not honour, or None if there is none."""
    unknown: list[str] = []
    unsupported: list[str] = []
    for name, value in body.items():
        if name in honoured or name in IGNORED or value is None or (name in NO_OP and value == NO_OP[name]):
            continue
        if name in VENDOR and isinstance(value, dict):
            unsupported += [f"{name}.{key}" for key in value if key not in VENDOR[name]]
            continue
        (unsupported if name in OPENAI or name in VENDOR else unknown).append(name)
    problems = []
    if unsupported:
        problems.append(
            f"{_names(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported by the {engine} engine"
        )
    if unknown:
        problems.append(
            f"{_names(unknown)} {'is' if len(unknown) == 1 else 'are'} not a chat completion "
            f"parameter the {engine} engine knows"
        )
    if not problems:
        return None
    return (
        f"{'; '.join(problems)}: remove {'it' if len(unsupported + unknown) == 1 else 'them'} from the request "
        f"(art-sky refuses what it would otherwise silently ignore). See the supported "
        "parameters in docs/guides/openai-clients.md"
    )


def honoured_only(body: dict[str, Any], honoured: frozenset[str] | set[str]) -> dict[str, Any]:
    """What the engine gets of an accepted request: its honoured parameters, without explicit nulls (what is left
    out is ignored harmlessly, as `refused` checked)."""
    return {k: v for k, v in body.items() if k in honoured and v is not None}


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in sorted(names))
