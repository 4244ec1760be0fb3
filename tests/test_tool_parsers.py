"""Tool calls of each template family come back as OpenAI tool calls: a call written by the family's own chat
template (tests/chat_templates.py, and the tiny model's Qwen2.5-style one) is read back by the parser chosen from that
template, as vLLM's parser of that name reads it; ART_SKY_TOOL_PARSER overrides the choice."""

from __future__ import annotations

import json

import pytest
from chat_templates import LLAMA31, MISTRAL
from transformers import AutoTokenizer

from art_sky.cluster.inference.tool_parsers import parser_name, portable_parser
from art_sky.cluster.model_state import resolve_base_model
from art_sky.cluster.tiny_model import CHAT_TEMPLATE
from art_sky.errors import ConfigError
from art_sky.settings import Settings

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
    {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
]
QUESTION = [{"role": "user", "content": "1 + 2 and 3 + 4?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_base_model("art-sky/tiny", Settings()))


@pytest.mark.parametrize(
    "template, family", [(CHAT_TEMPLATE, "hermes"), (LLAMA31, "llama3_json"), (MISTRAL, "mistral")]
)
def test_a_familys_calls_written_by_its_template_parse_back(tokenizer, template, family):
    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, chat_template=template, add_generation_prompt=generation_prompt
        )

    prompt = render(QUESTION, True)
    for calls in (CALLS[:1], CALLS):
        whole = render(QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls}], False)
        reply = whole[len(prompt) :] if whole.startswith(prompt) else whole[len(render(QUESTION, False)) :]
        reply = reply.removesuffix("<|im_end|>").removesuffix("\n").removesuffix("<|im_end|>")
        parser = portable_parser("", template)
        assert parser.name == family == parser_name("", template)
        content, parsed = parser.parse(reply)
        assert content is None
        assert [(name, json.loads(arguments)) for name, arguments in parsed] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
        ]


@pytest.mark.parametrize(
    "family, text, content, calls",
    [
        (
            "hermes",
            'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
            "Let me add.",
            [("add", {"a": 1})],
        ),
        ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}', None, [("add", {"a": 1})]),
        ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
        ("mistral", 'Adding.[TOOL_CALLS]add[ARGS]{"a": 1}', "Adding.", [("add", {"a": 1})]),
        ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ],
)
def test_text_around_calls_and_text_that_is_no_call(family, text, content, calls):
    parsed_content, parsed = portable_parser(family, None).parse(text)
    assert parsed_content == content and [(n, json.loads(a)) for n, a in parsed] == calls


def test_the_setting_overrides_the_template_and_an_unknown_parser_is_refused_by_name():
    assert parser_name("mistral", CHAT_TEMPLATE) == "mistral" and parser_name("none", LLAMA31) is None
    assert parser_name("pythonic", None) == "pythonic"  # vLLM has it: the vLLM engine is given it as it is
    with pytest.raises(ConfigError, match="ART_SKY_TOOL_PARSER='pythonic'"):
        portable_parser("pythonic", None)
