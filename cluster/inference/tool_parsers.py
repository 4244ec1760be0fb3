"""Tool calls read from a model's reply by template family, under vLLM's parser names, so the portable engine and
vLLM (`--tool-call-parser`) return the same `tool_calls`: hermes (Qwen2.5, Qwen3, Hermes: `<tool_call>{...}
</tool_call>`), llama3_json (Llama 3.1/3.2: a bare `{"name", "parameters"}` object, several split by `;`), mistral
(`[TOOL_CALLS][{...}]`, or `[TOOL_CALLS]name[ARGS]{...}` in newer templates). ART_SKY_TOOL_PARSER picks one;
unset, the chat template says which.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from art_sky.errors import ConfigError

Call = tuple[str, str]  # (function name, arguments as JSON text)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolParser:
    name: str
    marker: str | None  # text that may start a call: a stream holds it back until the reply ends
    parse: Callable[[str], tuple[str | None, list[Call]]]  # reply -> (content left, calls)
    keeps_special_tokens: bool = False  # the marker is a special token in the family's tokenizers


def _arguments(body: dict, *names: str) -> str:
    value: object = next((body[n] for n in names if n in body), {})
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _hermes(text: str) -> tuple[str | None, list[Call]]:
    calls = []
    for match in _HERMES.finditer(text):
        try:
            body = json.loads(match.group(1))
            calls.append((str(body["name"]), _arguments(body, "arguments", "parameters")))
        except (ValueError, KeyError, TypeError):
            continue
    if not calls:
        return text, []
    return _HERMES.sub("", text).strip() or None, calls


def _objects(text: str) -> list[dict] | None:
    """JSON objects one after another, split by `;` or whitespace; None unless that is all the text is."""
    objects, at = [], 0
    while at < len(text):
        while at < len(text) and text[at] in "; \t\r\n":
            at += 1
        if at == len(text):
            break
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return None
        objects.append(value)
    return objects


def _llama3_json(text: str) -> tuple[str | None, list[Call]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    objects = _objects(body)
    if not objects or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objects):
        return text, []
    return None, [(o["name"], _arguments(o, "parameters", "arguments")) for o in objects]


_MISTRAL_NAMED = re.compile(r"\s*([\w.-]+)\s*(?:\[ARGS\])?\s*(\{.*\})\s*$", re.DOTALL)


def _mistral(text: str) -> tuple[str | None, list[Call]]:
    if "[TOOL_CALLS]" not in text:
        return text, []
    before, *pieces = text.split("[TOOL_CALLS]")
    calls: list[Call] = []
    for piece in pieces:
        piece = piece.strip()
        if piece.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
            try:
                listed = _DECODER.raw_decode(piece)[0]
                calls += [(str(c["name"]), _arguments(c, "arguments", "parameters")) for c in listed]
            except (ValueError, KeyError, TypeError):
                return text, []
        elif (named := _MISTRAL_NAMED.match(piece)) is not None:  # name[ARGS]{...}
            try:
                json.loads(named.group(2))
            except ValueError:
                return text, []
            calls.append((named.group(1), named.group(2)))
        else:
            return text, []
    return before.strip() or None, calls


PARSERS = {
    "hermes": ToolParser("hermes", "<tool_call>", _hermes),
    "llama3_json": ToolParser("llama3_json", "{", _llama3_json),
    "mistral": ToolParser("mistral", "[TOOL_CALLS]", _mistral, keeps_special_tokens=True),
}


def parser_name(setting: str, chat_template: str | dict | None) -> str | None:
    """The parser a model's replies are read with: the setting (`none`: none), else its chat template's family."""
    if setting:
        return None if setting == "none" else setting
    template = " ".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "hermes"


def portable_parser(setting: str, chat_template: str | dict | None) -> ToolParser | None:
    """The portable engine's parser; a ConfigError naming the setting for one it does not have."""
    name = parser_name(setting, chat_template)
    if name is not None and name not in PARSERS:
        raise ConfigError(
            f"ART_SKY_TOOL_PARSER={name!r}: the portable engine parses tool calls with "
            f"{', '.join(sorted(PARSERS))} (or none); vLLM has more, with ART_SKY_ENGINE=vllm"
        )
    return PARSERS.get(name) if name else None
