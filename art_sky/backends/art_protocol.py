"""openpipe-art 0.5's side of a backend: its train keywords, its model's internal config, its SFT settings, and
`TrainResult`, translated to art-sky's wire messages. `Backend` (base.py) implements ART's Backend protocol with
these, so `art.TrainableModel.register(art_sky.LocalBackend())` works and an ART program changes one line.

Nothing here imports openpipe-art: ART's objects are read by their fields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from art_sky.errors import ConfigError
from art_sky.wire import ModelConfig, TrainConfig

log = logging.getLogger("art_sky")


@dataclass
class TrainResult:
    """What `backend.train(model, groups, ...)` returns, as ART 0.5's `TrainResult`: the step after training and
    the step's metrics; and art-sky's `totals`, the run's cumulative figures (`costs/cum/gpu`), kept apart because
    ART's `model.log(metrics=...)` computes its own cumulative keys and refuses given ones."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)


# ART 0.5's LocalBackend.train keywords that art-sky's trainer maps onto TrainConfig.
_MAPPED = {"learning_rate", "loss_fn", "epsilon", "epsilon_high", "kl_penalty_coef", "normalize_advantages",
           "scale_rewards", "beta", "max_grad_norm", "allow_training_without_logprobs"}
# The others, with the value that means "off" in ART: accepted at that value, refused at any other.
_ONLY_DEFAULT: dict[str, tuple[Any, str]] = {
    "loss_fn_config": (None, "art-sky's losses take no extra config"),
    "adam_params": (None, "the optimizer is AdamW with the learning rate you pass"),
    "kl_penalty_reference_step": (None, "the KL reference is the base model"),
    "kl_ref_adapter_path": (None, "the KL reference is the base model"),
    "advantage_balance": (0.0, "advantages are (reward - mean) / std per group"),
    "importance_sampling_level": ("token", "importance ratios are per token"),
    "max_negative_advantage_importance_sampling_weight": (None, "ratios are clipped by epsilon/epsilon_high only"),
    "mask_prob_ratio": (False, "ratios are clipped, not masked"),
    "kimi_k2_tau": (None, "not implemented"),
    "precalculate_logprobs": (False, "old logprobs are the ones the engine reported when it sampled"),
    "plot_tensors": (False, "not implemented"),
    "truncated_importance_sampling": (None, "not implemented"),
    "scale_learning_rate_by_reward_std_dev": (False, "the learning rate is used as given"),
    "logprob_calculation_chunk_size": (1024, "memory is bounded by ART_SKY_TRAIN_MICROBATCH_TOKENS on the server"),
    "packed_sequence_length": (None, "memory is bounded by ART_SKY_TRAIN_MICROBATCH_TOKENS on the server"),
    "num_trajectories_learning_rate_multiplier_power": (0.0, "the learning rate is used as given"),
    "save_checkpoint": (True, "every step is committed as a checkpoint"),
}


def train_config(config: TrainConfig | None, kwargs: dict[str, Any]) -> TrainConfig:
    """ART 0.5's `backend.train(...)` keywords as a TrainConfig. Without `config`, ART's defaults apply
    (loss_fn "cispo" with its clip [0, 5]; "ppo" clips at 0.2). A keyword the trainer cannot honour is refused,
    naming it; none is ignored."""
    for name, value in kwargs.items():
        if name in _MAPPED:
            continue
        if name not in _ONLY_DEFAULT:
            raise TypeError(f"backend.train() got an unexpected keyword argument {name!r}: art-sky takes ART 0.5's "
                            f"keywords ({', '.join(sorted(_MAPPED | _ONLY_DEFAULT.keys()))}) or config=TrainConfig")
        off, why = _ONLY_DEFAULT[name]
        if value != off:
            raise ConfigError(f"backend.train({name}={value!r}) is not supported by art-sky's trainer ({why}): "
                              f"leave it at {off!r}")
    values = {k: v for k, v in kwargs.items() if k in _MAPPED and v is not None}
    if values.pop("normalize_advantages", True) is False:
        values["scale_rewards"] = False
    if config is not None:
        base = config.model_dump()
    elif values.get("loss_fn", "cispo") == "cispo":
        base = {"loss_fn": "cispo", "epsilon": 1.0, "epsilon_high": 4.0}  # ART 0.5's defaults
    else:
        base = {}
    try:
        return TrainConfig(**base | values)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"backend.train({'.'.join(str(p) for p in first['loc'])}=...): {first['msg']}") from exc


# ART's `_internal_config` (art.dev.InternalModelConfig): what becomes the LoRA, what is only tuning for ART's own
# engine (ignored with a warning: art-sky's engine has its own settings), and the rest, refused.
_PEFT_KEYS = {"r": "lora_rank", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
              "target_modules": "target_modules"}
_TUNING = {"engine_args", "trainer_gpu_ids", "inference_gpu_ids", "allow_unvalidated_arch",
           "init_args.gpu_memory_utilization", "init_args.fast_inference", "init_args.enable_prefix_caching",
           "init_args.disable_log_stats", "init_args.use_async", "init_args.max_lora_rank",
           "init_args.use_gradient_checkpointing", "init_args.random_state", "init_args.float8_kv_cache",
           "peft_args.use_gradient_checkpointing", "peft_args.random_state", "peft_args.max_seq_length"}


def model_config(model: Any) -> ModelConfig:
    """The LoRA settings of a model: art-sky's own `config=ModelConfig(...)`, or ART's `_internal_config`
    (`peft_args` r / lora_alpha / lora_dropout / target_modules, `init_args.max_seq_length`), else the defaults.
    An ART model's `config` is the user's own rollout config and is never read."""
    if isinstance(getattr(model, "config", None), ModelConfig):
        return model.config
    internal = getattr(model, "_internal_config", None) or {}
    values: dict[str, Any] = {}
    ignored = []
    for section, settings in internal.items():
        if section in _TUNING:
            ignored.append(section)
            continue
        if section not in ("peft_args", "init_args") or not isinstance(settings, dict):
            raise ConfigError(f"_internal_config[{section!r}] is not supported by art-sky: remove it (LoRA settings "
                              "go in peft_args, the context length in init_args.max_seq_length)")
        for key, value in settings.items():
            if section == "peft_args" and key in _PEFT_KEYS:
                values[_PEFT_KEYS[key]] = value
            elif section == "init_args" and key == "max_seq_length":
                values["max_seq_length"] = value
            elif section == "peft_args" and key == "bias" and value == "none":
                continue
            elif f"{section}.{key}" in _TUNING:
                ignored.append(f"{section}.{key}")
            else:
                raise ConfigError(f"_internal_config[{section!r}][{key!r}] is not supported by art-sky: remove it "
                                  "(supported: peft_args r, lora_alpha, lora_dropout, target_modules; "
                                  "init_args.max_seq_length)")
    if ignored:
        log.warning("art-sky ignores these _internal_config settings of ART's own engine (the cluster server has "
                    "its own, ART_SKY_* variables): %s", ", ".join(ignored))
    try:
        return ModelConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"_internal_config: {first['loc'][0]}: {first['msg']}") from exc


def sft_settings(config: Any, dev_config: dict | None) -> tuple[int, list[float]]:
    """ART's TrainSFTConfig (read by its fields) as (batch size, learning rates); "auto" is 2, as ART's
    LocalBackend."""
    if dev_config:
        raise ConfigError(f"_train_sft's experimental config {sorted(dev_config)} is not supported by art-sky: "
                          "leave it empty")
    batch_size = getattr(config, "batch_size", "auto")
    rate = getattr(config, "learning_rate", 5e-5)
    return (2 if batch_size == "auto" else int(batch_size)), (list(rate) if isinstance(rate, list) else [rate])
