"""The CUDA trainer: Unsloth's FastLanguageModel (fused LoRA kernels, its gradient checkpointing) under the same
GRPO step as the PEFT trainer.

Only the model differs: the micro-batching, the loss (cluster/training/grpo.py), the fused LM head
(cluster/training/lm_head.py: Unsloth hands back the hidden states under UNSLOTH_RETURN_HIDDEN_STATES, as ART uses it)
and the optimizer step are PeftTrainer's, inherited, so both trainers compute one loss. Micro-batches stay padded rows
here (Unsloth's attention does not read transformers' packed format, and its own `packed_seq_lengths` path has not
run on a GPU of ours yet), and activation checkpointing is Unsloth's own, always on. Checkpoints are the PEFT layout
vLLM loads (save_pretrained of the PeftModel Unsloth returns). With `standby` (vLLM's GPU build on the same GPU) a
model whose weights Unsloth can share is loaded with vLLM inside (fast_inference), which the engine then serves from
(cluster/node/gpu_sharing.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

from ..inference.vllm_engine import vllm_lora_rank
from ..model_state import ADAPTER, DEFAULT_TARGET_MODULES, resolve_base_model
from ..node.gpu_sharing import standby_supported
from .peft_trainer import PeftTrainer, bf16_compute


class UnslothTrainer(PeftTrainer):
    name = "unsloth"

    def __init__(self, microbatch_tokens: int, standby: bool = False):
        super().__init__(microbatch_tokens, activation_checkpointing="on")
        self.standby = standby

    def load_model(self, request: RegisterRequest, settings: Settings, checkpoint: Path | None) -> tuple[Any, Any]:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from unsloth import FastLanguageModel

        cfg = request.config
        source = resolve_base_model(request.base_model, settings)
        shared = {}
        if self.standby and standby_supported(AutoConfig.from_pretrained(source)):
            shared = dict(
                fast_inference=True,
                gpu_memory_utilization=settings.engine_gpu_memory,
                max_lora_rank=vllm_lora_rank(cfg.lora_rank),
            )
        try:
            base, tokenizer = FastLanguageModel.from_pretrained(
                model_name=source, max_seq_length=cfg.max_seq_length, dtype=None, load_in_4bit=False, **shared
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"Unsloth cannot load base model {request.base_model!r}: {exc}. Use a local Hugging "
                "Face model directory or a hub id on a node with internet access"
            ) from exc
        if tokenizer.chat_template is None:
            raise ConfigError(f"base model {request.base_model!r} has no chat template; art-sky trains chat models")
        model = FastLanguageModel.get_peft_model(
            base,
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            bias="none",
            target_modules=cfg.target_modules or DEFAULT_TARGET_MODULES,
            use_gradient_checkpointing="unsloth",
            random_state=0,
        )
        if checkpoint is not None:
            weights = load_file(str(checkpoint / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER)
            # peft annotates its return as `namedtuple` (the function); it is torch's _IncompatibleKeys
            unexpected = result.unexpected_keys  # type: ignore[attr-defined]
            if unexpected:
                raise ConfigError(
                    f"checkpoint {checkpoint} does not fit this model's LoRA (unexpected keys "
                    f"{unexpected[:3]}): register with the LoRA settings it was trained "
                    "with"
                )
        self.refuse_unfit(request, model)
        return model, tokenizer

    def packs(self, model: Any) -> bool:
        return False

    def _hidden(self, model: Any, inputs: dict[str, Any]) -> Any:
        with _returning_hidden_states(), bf16_compute(model):
            return model(**inputs).logits

    def _checkpointing(self, model: Any, tokens: int) -> None:
        """Unsloth's own checkpointing is on (use_gradient_checkpointing="unsloth")."""


@contextmanager
def _returning_hidden_states() -> Iterator[None]:
    """Unsloth's causal LMs return their final hidden states as `logits` while UNSLOTH_RETURN_HIDDEN_STATES is 1."""
    prior = os.environ.get("UNSLOTH_RETURN_HIDDEN_STATES")
    os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
    try:
        yield
    finally:
        if prior is None:
            os.environ.pop("UNSLOTH_RETURN_HIDDEN_STATES", None)
        else:
            os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = prior
