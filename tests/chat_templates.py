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
# Reasoning templates as vLLM's parsers expect them (tests/test_reasoning.py). QWEN3: the model opens its own think
# block; enable_thinking=False closes an empty one in the prompt; a turn's reasoning (reasoning_content, or a think
# block in its content) is rendered only after the last user message. DEEPSEEK_R1: the generation prompt opens the
# think block; history keeps only what came after </think>.
QWEN3 = """\
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set text = m.content or '' -%}
{%- set reasoning = m.reasoning_content or '' -%}
{%- if '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
{%- set text = text.split('</think>')[-1] -%}
{%- endif -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_query and reasoning %}<think>{{ reasoning }}</think>{% endif %}{{ text }}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif -%}
{%- endif %}"""
DEEPSEEK_R1 = """\
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set text = m.content or '' -%}
{%- if '</think>' in text -%}{%- set text = text.split('</think>')[-1] -%}{%- endif -%}
<|im_start|>assistant
{{ text }}<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
<think>
{% endif -%}"""
TEMPLATES = {
    "think": THINK,
    "tool_json": TOOL_JSON,
    "trim": TRIM,
    "all": ALL,
    "llama31": LLAMA31,
    "mistral": MISTRAL,
    "thinking": THINKING,
}
REASONING_TEMPLATES = {"qwen3": QWEN3, "deepseek_r1": DEEPSEEK_R1}


def template_model(root: Path, name: str) -> Path:
    """A copy of the tiny model whose chat template is TEMPLATES[name] (read by transformers and by vLLM)."""
    path = Path(root) / f"tiny-{name}"
    if not path.exists():
        shutil.copytree(resolve_base_model("art-sky/tiny", Settings()), path)
        (path / "chat_template.jinja").write_text(TEMPLATES[name])
    return path


def forced_model(root: Path, name: str, reply: str) -> Path:
    """A tiny model with REASONING_TEMPLATES[name] that answers `reply` to every prompt ending in a newline, token
    for token: its layers add nothing (attention and MLP outputs zero), so each position's logits are its own
    token's, and the output matrix maps each token of the chain newline, reply..., <|im_end|> to the next one by a
    margin no sample at temperature 1 crosses. The reply's characters must differ from each other and from "\\n"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(root) / f"forced-{name}"
    if path.exists():
        return path
    source = resolve_base_model("art-sky/tiny", Settings())
    tokenizer = AutoTokenizer.from_pretrained(source)
    chain = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize("\n" + reply)]
    assert len(chain) == len(set(chain)) == len(reply) + 1, "the reply's characters must all differ"
    chain.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    embeddings = model.get_input_embeddings().weight.detach()
    output = torch.zeros_like(embeddings)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for current, following in zip(chain, chain[1:], strict=False):
            output[following] = 5.0 * embeddings[current] / embeddings[current].norm()
        model.lm_head = torch.nn.Linear(embeddings.shape[1], embeddings.shape[0], bias=False)
        model.lm_head.weight.copy_(output)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").write_text(REASONING_TEMPLATES[name])
    return path
