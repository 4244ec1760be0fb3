"""LangChain's `with_structured_output` against a model's endpoint, both of its methods: what the engines' tests
check alike (tests/test_any_client.py on the portable engine, tests/test_vllm_engine.py on vLLM)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Answer(BaseModel):
    ok: bool
    word: Literal["sea", "sky"]


async def check_structured_output(model) -> None:
    """Both methods (response_format json_schema; a named tool with parallel_tool_calls=false) return a parsed
    `Answer`: the reply is constrained to compact JSON whose every field is bounded (`{"ok":false,"word":"sky"}` is
    the longest: 25 bytes, then the end token), so even the untrained tiny model's is one, whatever it samples."""
    from langchain_openai import ChatOpenAI

    for method in ("json_schema", "function_calling"):
        for seed in (1, 2, 3):
            llm = ChatOpenAI(model=model.name, base_url=model.inference_base_url, api_key=model.inference_api_key,
                             max_tokens=40, seed=seed)
            parsed = await llm.with_structured_output(Answer, method=method, strict=True).ainvoke("Sea or sky?")
            assert isinstance(parsed, Answer), method
