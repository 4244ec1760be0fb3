"""Models for benchmarks and GPU tests, built from a config with random weights (nothing downloads): Qwen2 at the
shapes of Qwen2.5-0.5B, 1.5B, 7B and 14B, with art-sky/tiny's byte-level tokenizer and chat template, saved as a
Hugging Face directory the server loads like any other. Plus GRPO training sequences of a chosen shape (equal or
mixed lengths) and FLOP counts.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

# name -> Qwen2Config fields; vocabulary and tied embeddings as the real models (the LM head is a large share
# of a small model's compute). "tiny" is art-sky/tiny itself; "tiny-152k-vocab" its body under Qwen's vocabulary
# size, where the LM head is most of the work (a CPU-sized stand-in for what a small model's head costs).
SHAPES: dict[str, dict] = {
    "tiny": {},
    "tiny-152k-vocab": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-14b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}
LARGE = {"qwen2.5-7b", "qwen2.5-14b"}  # built in bf16 on the GPU where there is one: minutes in float32 on a CPU


def build(shape: str, cache_dir: Path) -> Path:
    """A model directory of `shape` under cache_dir (built once; random weights from a fixed seed, bf16 on disk)."""
    from art_sky.cluster.tiny_model import tiny_model_path

    tiny = tiny_model_path(cache_dir)
    if shape == "tiny":
        return tiny
    path = Path(cache_dir) / "models" / f"random-{shape}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    special = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (("bos", "<|endoftext|>"), ("eos", "<|im_end|>"))
    }
    config = Qwen2Config(
        **({"tie_word_embeddings": True} | SHAPES[shape]),
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    if shape in LARGE:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
        model = model.cpu()
    else:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=[special["eos"], special["bos"]], pad_token_id=tokenizer.pad_token_id
    )
    tmp = path.with_name(path.name + ".tmp")
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


def sequences(rows: int, length: int, prompt: int, vocab: int, seed: int = 0, mixed: bool = False):
    """GRPO training sequences: `prompt` masked tokens then sampled ones up to `length` tokens (`mixed`: a length
    drawn uniformly from prompt + 16 to `length` for each, as a GRPO group's answers differ), advantages +-1.

    The old logprobs are placeholders (NaN: ratio 1, the plain policy gradient); `with_old_logprobs` fills them
    with the model's own, as an engine would have reported them.
    """
    from art_sky.cluster.training.sequences import Sequence

    rng = random.Random(seed)
    out = []
    for row in range(rows):
        size = rng.randint(min(prompt + 16, length), length) if mixed else length
        ids = [rng.randrange(3, min(vocab, 256)) for _ in range(size)]
        trained = [False] * prompt + [True] * (size - prompt)
        out.append(Sequence(ids, trained, [math.nan] * size, 1.0 if row % 2 else -1.0))
    return out


def with_old_logprobs(model, batch) -> None:
    """Fill each sequence's old logprobs at its trained tokens with the model's current logprobs (no gradient)."""
    import torch

    device = next(model.parameters()).device
    with torch.no_grad():
        for seq in batch:
            ids = torch.tensor([seq.token_ids], device=device)
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()
            seq.old_logprobs = [math.nan] + [
                lp if t else math.nan for lp, t in zip(picked, seq.trained[1:], strict=False)
            ]


def training_flops(config, tokens: int, length: int) -> float:
    """Model FLOPs of one LoRA training pass over `tokens` tokens in sequences of `length`: forward plus the
    backward to the activations (frozen weights get no gradient), i.e. 2 x forward; LoRA's own tiny matmuls left
    out. Forward per token: 2 x (non-embedding weights + the LM head) + attention's 4 x layers x length x hidden.
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    attention_weights = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    mlp_weights = 3 * hidden * config.intermediate_size
    matmul_weights = layers * (attention_weights + mlp_weights) + hidden * config.vocab_size
    forward = 2 * matmul_weights + 4 * layers * length * hidden
    return 2.0 * forward * tokens


# Dense bf16 peak of the GPUs we rent (no sparsity), TFLOP/s; MFU is reported only for these unless given.
PEAK_TFLOPS = {
    "H100": 989.0,
    "H200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
    "RTX 4090": 165.0,
}


def peak_tflops(device_name: str) -> float | None:
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in device_name), None)
