"""LangChain's `with_structured_output` against a model's endpoint, both of its methods: what the engines' tests
check alike (tests/test_any_client.py on the portable engine, tests/test_vllm_engine.py on vLLM)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel


class Answer(BaseModel):
    ok: bool
    word: Literal["sea", "sky"]


async def check_structured_output(model, free_call_whitespace: bool = False) -> None:
    """Both methods (response_format json_schema; a named tool with parallel_tool_calls=false) return a parsed
    `Answer`: the reply is constrained to compact JSON whose every field is bounded (`{"ok":false,"word":"sky"}` is
    the longest: 25 bytes, then the end token), so even the untrained tiny model's is one, whatever it samples.

    `free_call_whitespace` (vLLM 0.32): a tool call's arguments, though pinned to the tool's schema (LangChain sends
    it strict), come from a structural tag whose JSON may carry any whitespace, which a random model can pad past
    max_tokens; what holds for every sample is a parsed `Answer`, or a reply cut while it writes the call to it."""
    from langchain_openai import ChatOpenAI

    for method in ("json_schema", "function_calling"):
        for seed in (1, 2, 3):
            llm = ChatOpenAI(
                model=model.name,
                base_url=model.inference_base_url,
                api_key=model.inference_api_key,
                max_tokens=80,
                seed=seed,
            )
            out = await llm.with_structured_output(Answer, method=method, strict=True, include_raw=True).ainvoke(
                "Sea or sky?"
            )
            if isinstance(out["parsed"], Answer):
                continue
            raw = out["raw"]
            assert method == "function_calling" and free_call_whitespace, (method, raw)
            assert raw.response_metadata.get("finish_reason") == "length", raw
            assert re.match(r'<tool_call>\n?\{"name": "Answer", "arguments": \{', raw.content), raw.content
