"""Chat templates rendered as vLLM renders them, shared by the portable engine (the prompt it samples from) and the
sequence builder (the context of a choice that came without its prompt ids), so both see what vLLM would.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from art_sky.errors import TokenizationError


def render(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None,
    generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The chat template's text for these messages, read as vLLM reads them (see `_as_vllm_reads`), with the
    request's `chat_template_kwargs` the template reads (see `template_arguments`)."""
    return tokenizer.apply_chat_template(
        _conversation(tokenizer, messages),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **template_arguments(tokenizer, template_kwargs),
    )


def prompt_ids(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The token ids an engine samples a reply to."""
    return encode(tokenizer, render(tokenizer, messages, tools, True, template_kwargs))


# What a request's chat_template_kwargs may not set: the rendering's own arguments (vLLM refuses `chat_template` and
# `tokenize` the same way; the others are the request's own fields, or the engine's).
RESERVED_TEMPLATE_ARGUMENTS = frozenset(
    {
        "chat_template",
        "tokenize",
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "tokenizer_kwargs",
    }
)


def template_arguments(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's `chat_template_kwargs` as vLLM passes them: those the template reads (`enable_thinking`,
    `preserve_thinking`, ...), the others left out, since the template's text cannot depend on them. One that
    would set the rendering itself is a TokenizationError naming it."""
    if not template_kwargs:
        return {}
    reserved = sorted(RESERVED_TEMPLATE_ARGUMENTS & template_kwargs.keys())
    if reserved:
        raise TokenizationError(
            f"chat_template_kwargs {reserved} set the rendering itself, not a template variable: "
            "remove them (the request's own fields say these)"
        )
    template = tokenizer.chat_template
    variables = _template_variables(" ".join(template.values()) if isinstance(template, dict) else template or "")
    return {key: value for key, value in template_kwargs.items() if key in variables}


@functools.lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (jinja2's undeclared variables), read once per template."""
    import jinja2
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} tag, parsed as plain content
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def _conversation(tokenizer: Any, messages: list[dict]) -> list[dict]:
    """The messages as vLLM hands them to a text model's template: text content parts as one text joined by
    newlines, or as text parts where the template loops over a message's content (vLLM's "openai" content format;
    templates such as Qwen3's render a list as nothing); and `developer` turned into `system` where the template
    does not know the role (it would drop the message), the system messages then merged into one at the start."""
    template = tokenizer.chat_template
    parts, knows_developer = _template_reads(
        " ".join(template.values()) if isinstance(template, dict) else template or ""
    )
    conversation = [_as_vllm_reads(_text_content(m, index, parts)) for index, m in enumerate(messages)]
    if knows_developer or not any(m.get("role") == "developer" for m in conversation):
        return conversation
    system = ("system", "developer")
    merged = "\n\n".join(_joined(m["content"]) for m in conversation if m.get("role") in system and m.get("content"))
    return [{"role": "system", "content": merged}] + [m for m in conversation if m.get("role") not in system]


# `{% for part in message.content %}`, `in message['content']`, `in content`: vLLM then keeps content parts
_LOOPS_OVER_CONTENT = re.compile(
    r"""\bfor\s+\w+\s+in\s+(?:\w+\s*(?:\.\s*content\b|\[\s*['"]content['"]\s*\])|content\b)"""
)


@functools.lru_cache(maxsize=32)
def _template_reads(template: str) -> tuple[bool, bool]:
    """Whether a template loops over content parts, and whether it knows the developer role (vLLM's own test); read
    once per template, not per request."""
    return bool(_LOOPS_OVER_CONTENT.search(template)), '"developer"' in template or "'developer'" in template


_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}  # type -> field


def _text_content(message: dict, index: int, parts: bool) -> dict:
    """A message's content parts read as text (as parts of type text, or joined); a part of any other kind (an
    image, audio, a file) is a TokenizationError naming it: art-sky serves text models."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get(_TEXT_PARTS[kind]) if kind in _TEXT_PARTS else None
        if not isinstance(text, str):
            raise TokenizationError(
                f"messages[{index}].content[{number}] has type {kind!r}: art-sky serves text models, so content parts "
                "must be text ({'type': 'text', 'text': ...})"
            )
        texts.append(text)
    return {**message, "content": [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)}


def _joined(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)


def _as_vllm_reads(message: dict) -> dict:
    """vLLM's reading of a message, so that the portable engine and the training fallback render what vLLM renders:
    tool-call arguments as objects (JSON text parsed; invalid JSON becomes {}, as vLLM does) and reasoning under both
    names templates use."""
    calls = message.get("tool_calls")
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if not calls and reasoning is None:
        return message
    message = dict(message)
    if calls:
        message["tool_calls"] = [_with_object_arguments(call) for call in calls]
    if reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = reasoning
    return message


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            arguments = {}
    elif arguments is None:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
