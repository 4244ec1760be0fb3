"""Chat templates that rewrite history the way real ones do, and tiny-model variants that carry them.

- THINK (Qwen3's): the generation prompt opens an empty think block; assistant turns before the last user message
  are rendered without their think block, those after it (the current tool loop) with it.
- TOOL_JSON: tool-call arguments are re-serialised (keys sorted), whatever the model wrote; Qwen2.5's and Hermes'
  templates re-serialise with `tojson` the same way.
- TRIM (Llama 3's): every message's content is trimmed of surrounding whitespace.
- ALL: the three at once (one vLLM server serves one base model, so the vLLM test uses this one).
- LLAMA31, MISTRAL: the tool-call formats of Llama 3.1 (bare JSON) and Mistral ([TOOL_CALLS] and a JSON list);
  Qwen2.5's (Hermes' <tool_call>) is the tiny model's own.
- THINKING (Qwen3.5's and DeepSeek-R1's switches, read from chat_template_kwargs): `enable_thinking` (default true)
  opens a think block in the generation prompt, false closes it empty; `preserve_thinking` (default false) keeps
  earlier turns' reasoning, where the default drops it (history rewritten once a later user turn comes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from art_sky.cluster.model_state import resolve_base_model
from art_sky.settings import Settings

_SYSTEM = """\
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
"""

_PLAIN_TEXT = "{%- set text = m.content or '' -%}\n"
_TRIMMED_TEXT = "{%- set text = (m.content or '') | trim -%}\n"

# Qwen3: reasoning moves out of the content; only turns after the last user message keep their think block.
_THINK_TURN = """\
{%- set reasoning = m.reasoning_content or '' -%}
{%- if '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1].strip() -%}
{%- set text = text.split('</think>')[-1].lstrip() -%}
{%- endif -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_query %}<think>
{{ reasoning }}
</think>

{% endif %}{{ text }}"""
_PLAIN_TURN = """\
<|im_start|>assistant
{{ text }}"""

_ARGUMENTS_AS_GIVEN = "{{ call.arguments | tojson }}"
_ARGUMENTS_SORTED = (
    "{% set args = call.arguments if call.arguments is mapping else {} -%}"
    "{ {%- for key, value in args | dictsort -%}{{ key | tojson }}: {{ value | tojson }}"
    "{%- if not loop.last %}, {% endif -%}{%- endfor -%} }"
)

_CALLS_AND_REST = """
{%- for call in m.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call %}
<tool_call>
{"name": "{{ call.name }}", "arguments": ARGUMENTS}
</tool_call>
{%- endfor -%}
<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ text }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ text }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
GENERATION{% endif %}"""


def _template(*, think: bool, tool_json: bool, trim: bool) -> str:
    return (
        _SYSTEM
        + "{%- for m in messages -%}\n"
        + (_TRIMMED_TEXT if trim else _PLAIN_TEXT)
        + "{%- if m.role == 'system' and loop.first -%}\n{%- elif m.role == 'assistant' -%}\n"
        + (_THINK_TURN if think else _PLAIN_TURN)
        + _CALLS_AND_REST.replace("ARGUMENTS", _ARGUMENTS_SORTED if tool_json else _ARGUMENTS_AS_GIVEN).replace(
            "GENERATION", "<|im_start|>assistant\n<think>\n\n</think>\n\n" if think else "<|im_start|>assistant\n"
        )
    )


THINK = _template(think=True, tool_json=False, trim=False)
TOOL_JSON = _template(think=False, tool_json=True, trim=False)
TRIM = _template(think=False, tool_json=False, trim=True)
ALL = _template(think=True, tool_json=True, trim=True)

# Tool-call families as vLLM's parsers name them, the calls written as each family's real template writes them.
# Llama 3.1 (llama3_json): a bare {"name", "parameters"} object as the assistant turn.
LLAMA31 = """\
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Respond with {"name": function name, "parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>{% endif -%}
{%- for m in messages -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>

{% if m.tool_calls -%}
{%- for call in m.tool_calls -%}{%- set call = call.function if call.function is defined else call -%}
{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}{% if not loop.last %}; {% endif %}
{%- endfor -%}
{%- else -%}{{ m.content | trim }}{%- endif -%}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif -%}"""
# Mistral (mistral): [TOOL_CALLS] then a JSON list of {"name", "arguments"}.
MISTRAL = """\
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{ m.content or '' }}{% if m.tool_calls %}[TOOL_CALLS][{% for call in m.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}{% if not loop.last %}, {% endif %}
{%- endfor %}]{% endif %}<|im_end|>
{%- elif m.role == 'tool' -%}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- else -%}[INST]{{ m.content }}[/INST]{%- endif -%}
{%- endfor -%}"""
THINKING = """\
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
<|im_start|>assistant
{% if preserve_thinking and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}
{%- endif %}"""
TEMPLATES = {
    "think": THINK,
    "tool_json": TOOL_JSON,
    "trim": TRIM,
    "all": ALL,
    "llama31": LLAMA31,
    "mistral": MISTRAL,
    "thinking": THINKING,
}


def template_model(root: Path, name: str) -> Path:
    """A copy of the tiny model whose chat template is TEMPLATES[name] (read by transformers and by vLLM)."""
    path = Path(root) / f"tiny-{name}"
    if not path.exists():
        shutil.copytree(resolve_base_model("art-sky/tiny", Settings()), path)
        (path / "chat_template.jinja").write_text(TEMPLATES[name])
    return path
