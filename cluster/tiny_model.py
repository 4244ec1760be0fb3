"""The embedded default model, `art-sky/tiny`: a tiny Qwen2 built from code, offline and deterministically.

Byte-level tokenizer (every UTF-8 byte is a token, no merges), ChatML chat template with tools, and random
weights from a fixed seed. head_dim is 64 so vLLM can serve it too. Built once, cached under the cache dir.
"""

from __future__ import annotations

from pathlib import Path

from art_sky.files import atomic_dir

TINY_MODEL_NAME = "art-sky/tiny"
_VERSION = "v1"
_SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}{%- elif content -%}{%- for part in content -%}{{ part.text }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions. Their signatures are within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ text(message.content) }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ text(message.content) }}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{% if loop.first and message.content %}
{% endif %}<tool_call>
{"name": "{{ call.name }}", "arguments": {% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ text(message.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""


def tiny_model_path(cache_dir: Path) -> Path:
    """Where the tiny model lives; built on first use."""
    path = Path(cache_dir) / "models" / f"tiny-{_VERSION}"
    if not (path / "config.json").exists():
        _build(path)
    return path


def _build(path: Path) -> None:
    """Build into a temp dir, then rename: concurrent builders never see half a model. When another process
    finished first, its build (identical) is kept."""
    with atomic_dir(path, replace=False) as tmp:
        tokenizer = _tokenizer()
        tokenizer.save_pretrained(tmp)
        _model(tokenizer).save_pretrained(tmp)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=2048,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.add_tokens(ADDED_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _model(tokenizer):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: the smallest vLLM's CPU attention accepts
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(_SEED)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, config.bos_token_id], pad_token_id=config.pad_token_id
    )
    return model
