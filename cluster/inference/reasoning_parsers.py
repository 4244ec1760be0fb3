"""A reply's reasoning apart from its content, under vLLM's `--reasoning-parser` names and with vLLM 0.32's
semantics, so the portable engine answers as vLLM does (`reasoning_content` beside `content`):

- deepseek_r1: everything up to `</think>` is reasoning (the template opens `<think>` itself; one the model writes
  is dropped, with what came before it); no `</think>` yet: all reasoning.
- qwen3: reasoning until `</think>` or a `<tool_call>` (which ends it and stays in the content); `<think>` inside
  the reasoning and a second `</think>` are dropped; no `</think>` yet: all reasoning; `enable_thinking=False` in
  the request's chat_template_kwargs: all content.

The split is of the reply's text only: the sampled token ids the trainer gets are the reply's, reasoning in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from art_sky.wire import REASONING_PARSERS

Split = tuple[str | None, str | None]  # (reasoning, content)
_START, _END, _TOOL = "<think>", "</think>", "<tool_call>"


def _deepseek_r1(text: str, kwargs: dict[str, Any]) -> Split:
    before, mark, after = text.partition(_START)
    text = after if mark else before
    if _END not in text:
        return text, None
    reasoning, _, content = text.partition(_END)
    return reasoning, content or None


def _qwen3(text: str, kwargs: dict[str, Any]) -> Split:
    if kwargs.get("enable_thinking", True) is False:
        return None, text or None
    ends = [at for at in (text.find(_END), text.find(_TOOL)) if at >= 0]
    if not ends:
        return text.replace(_START, "") or None, None
    at = min(ends)
    reasoning = text[:at].replace(_START, "")
    content = text[at + len(_END) :] if text.startswith(_END, at) else text[at:]
    return reasoning or None, content.replace(_END, "") or None


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    split: Callable[[str, dict[str, Any]], Split]
    markers: tuple[str, ...]  # text that changes the split: a stream holds back a partial one

    def partial(self, text: str, kwargs: dict[str, Any]) -> tuple[str, str]:
        """The split of a reply still being sampled, a trailing piece of a marker held back."""
        for marker in self.markers:
            for size in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:size]):
                    text = text[:-size]
                    break
        reasoning, content = self.split(text, kwargs)
        return reasoning or "", content or ""


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", _deepseek_r1, (_START, _END)),
    "qwen3": ReasoningParser("qwen3", _qwen3, (_START, _END, _TOOL)),
}
assert set(PARSERS) == set(REASONING_PARSERS)  # the names the wire accepts are the ones parsed here
