"""What art-sky reads from a model to register it, art-sky's or ART's, and ART's SFT settings.

- The run: ART (0.5.20+) keys a model's checkpoints, history and logs by `run_name` (a new run_name is a new
  lineage at step 0); ART 0.5.18 and art-sky models without one use `name` for both. Each run is served and
  addressed as `served(model)`: `name`, or `name:run` for another run, so several runs of a name train side by side.
- The LoRA: art-sky's `config=ModelConfig(...)`; ART's `lora_config=art.dev.LoRAConfig(...)` (0.5.20+) or
  `_internal_config.peft_args` (0.5.18); `init_args.max_seq_length`. An ART model's `config` is the user's own
  rollout config and is never read. ART's engine tuning is ignored with a warning (the cluster server has its own
  ART_SKY_* settings), but for `engine_args.reasoning_parser` (vLLM's, which both engines honour); anything else is
  refused by name.
- The chat template's arguments ART's client sends with every completion (`chat_template_kwargs`): the training
  context of a turn that came back without its token ids is rendered with the same ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal, cast

from pydantic import ValidationError

from art_sky.errors import ConfigError, first_problem
from art_sky.wire import ModelConfig, RegisterRequest, served_name

log = logging.getLogger("art_sky")

# ART 0.5.18's `_internal_config.peft_args` and 0.5.20's `lora_config` keys -> ModelConfig fields.
_PEFT_ARGS = {
    "r": "lora_rank",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "target_modules": "target_modules",
}
_LORA_CONFIG = {
    "rank": "lora_rank",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "target_modules",
    "max_seq_length": "max_seq_length",
}
# Settings of ART's own engine and trainer processes: art-sky's server has its own (ART_SKY_* variables).
_TUNING = {
    "engine_args",
    "trainer_gpu_ids",
    "inference_gpu_ids",
    "allow_unvalidated_arch",
    "trainer_args",
    "vllm_runtime",
    "chat_template_content_format",
    "chat_template_tool_schema_format",
    "init_args.gpu_memory_utilization",
    "init_args.fast_inference",
    "init_args.enable_prefix_caching",
    "init_args.disable_log_stats",
    "init_args.use_async",
    "init_args.max_lora_rank",
    "init_args.use_gradient_checkpointing",
    "init_args.random_state",
    "init_args.float8_kv_cache",
    "peft_args.use_gradient_checkpointing",
    "peft_args.random_state",
    "peft_args.max_seq_length",
    "lora_config.use_gradient_checkpointing",
    "lora_config.random_state",
    "lora_config.temporary_location",
}
# ART's options whose default is what art-sky does: accepted at that value.
_DEFAULTS = {
    "rollout_weight_update_mode": "step_lora",
    "peft_args.bias": "none",
    "lora_config.bias": "none",
    "lora_config.use_rslora": False,
    "lora_config.init_weights": True,
    "lora_config.layers_to_transform": None,
    "lora_config.layers_pattern": None,
    "lora_config.modules_to_save": None,
}
_SUPPORTED = (
    "lora_config rank, alpha, dropout, target_modules, max_seq_length; _internal_config.peft_args r, "
    "lora_alpha, lora_dropout, target_modules; init_args.max_seq_length; engine_args.reasoning_parser; "
    "chat_template_kwargs"
)


def register_request(model: Any, request_id: str) -> RegisterRequest:
    """The registration of a trainable model (art-sky's or ART's, read by its fields)."""
    try:
        return RegisterRequest(
            name=model.name,
            project=model.project,
            run_name=run_name(model),
            base_model=model.base_model,
            config=model_config(model),
            request_id=request_id,
        )
    except ValidationError as exc:
        where, wrong = first_problem(exc)
        raise ConfigError(
            f"model {getattr(model, 'name', '?')!r}: {where}: {wrong} (names are letters, digits, '.', '_' and '-', "
            "up to 128)"
        ) from exc


def run_name(model: Any) -> str | None:
    """The model's lineage (ART's `run_name`), or None: its name."""
    value = getattr(model, "run_name", None)
    return value if isinstance(value, str) and value else None


def served(model: Any) -> str:
    """The name the server serves the model's run under and addresses it by (`wire.served_name`)."""
    return served_name(model.name, run_name(model))


def model_config(model: Any) -> ModelConfig:
    """The LoRA settings of a model: art-sky's `config=ModelConfig(...)`, else ART's `lora_config` and
    `_internal_config`, else the defaults."""
    if isinstance(getattr(model, "config", None), ModelConfig):
        return model.config
    internal = getattr(model, "_internal_config", None) or {}
    values: dict[str, Any] = {}
    ignored: list[str] = []
    for section, settings in internal.items():
        if section == "engine_args" and isinstance(settings, dict) and "reasoning_parser" in settings:
            values["reasoning_parser"] = settings["reasoning_parser"]  # vLLM's --reasoning-parser, on both engines
            ignored += [f"engine_args.{key}" for key in settings if key != "reasoning_parser"]
        elif section in _TUNING:
            ignored.append(section)
        elif section == "chat_template_kwargs":
            continue  # read by chat_template_kwargs()
        elif section in ("peft_args", "init_args") and isinstance(settings, dict):
            for key, value in settings.items():
                if section == "init_args" and key == "max_seq_length":
                    values["max_seq_length"] = value
                elif section == "peft_args" and key in _PEFT_ARGS:
                    values[_PEFT_ARGS[key]] = value
                else:
                    _other(f"{section}.{key}", value, f"_internal_config[{section!r}][{key!r}]", ignored)
        else:
            _other(section, settings, f"_internal_config[{section!r}]", ignored)
    for key, value in (getattr(model, "lora_config", None) or {}).items():
        if key in _LORA_CONFIG:
            values[_LORA_CONFIG[key]] = value
        else:
            _other(f"lora_config.{key}", value, f"lora_config[{key!r}]", ignored)
    if ignored:
        log.warning(
            "art-sky ignores these settings of ART's own engine and trainer (the cluster server has its own, "
            "ART_SKY_* variables): %s",
            ", ".join(ignored),
        )
    try:
        return ModelConfig(**values)
    except ValidationError as exc:
        where, wrong = first_problem(exc)
        raise ConfigError(f"the model's settings: {where}: {wrong}") from exc


_OPENAI_SERVER_CONFIG = ("log_file", "server_args", "engine_args")  # ART's dev.OpenAIServerConfig


def openai_server_config(config: Any) -> None:
    """ART's `register(_openai_client_config=...)`: settings of ART's own vLLM server process, which art-sky's
    cluster server replaces (its engine has its own, ART_SKY_* variables): named in a warning, as
    `_internal_config.engine_args` is. A key ART does not define is refused, as ART's TypedDict would flag it."""
    if not config:
        return
    if not isinstance(config, dict):
        raise ConfigError(
            f"register(_openai_client_config={config!r}): ART takes a dict ({', '.join(_OPENAI_SERVER_CONFIG)})"
        )
    unknown = sorted(set(config) - set(_OPENAI_SERVER_CONFIG))
    if unknown:
        raise ConfigError(
            f"register(_openai_client_config=...) has {unknown}, which ART's OpenAIServerConfig does not define "
            f"(it has {', '.join(_OPENAI_SERVER_CONFIG)}): remove them"
        )
    ignored = [
        f"{key}.{name}" if name else key
        for key, value in config.items()
        for name in (list(value) if isinstance(value, dict) and value else [""])
    ]
    log.warning(
        "art-sky ignores these settings of ART's own vLLM server (the cluster server's engine has its own, "
        "ART_SKY_* variables): _openai_client_config %s",
        ", ".join(ignored),
    )


def _other(key: str, value: Any, where: str, ignored: list[str]) -> None:
    """A setting art-sky does not map: tuning (ignored, named), ART's default (accepted), else refused."""
    if key in _TUNING:
        ignored.append(key)
    elif key in _DEFAULTS and value == _DEFAULTS[key]:
        return
    elif key in _DEFAULTS:
        raise ConfigError(
            f"{where}={value!r} is not supported by art-sky: leave it at {_DEFAULTS[key]!r} (supported: {_SUPPORTED})"
        )
    else:
        raise ConfigError(f"{where} is not supported by art-sky: remove it (supported: {_SUPPORTED})")


def chat_template_kwargs(model: Any) -> dict[str, Any] | None:
    """The chat template's arguments the model's client sends with every completion: ART's (0.5.20+ sends
    `preserve_thinking` and the model's `_internal_config.chat_template_kwargs`), or None."""
    defaults = getattr(model, "_default_chat_completion_extra_body", None)
    if callable(defaults):
        body = defaults() or {}
        kwargs = body.get("chat_template_kwargs") if isinstance(body, dict) else None
    else:
        kwargs = (getattr(model, "_internal_config", None) or {}).get("chat_template_kwargs")
    return dict(kwargs) if isinstance(kwargs, dict) else None


def sft_settings(config: Any, dev_config: Mapping[str, Any] | None) -> tuple[int, list[float], Literal["all", "last"]]:
    """ART's TrainSFTConfig (read by its fields) and `_config`, as (batch size, learning rates, which assistant
    turns train). "auto" is 2, as ART's LocalBackend. Of `_config`, `metric_logging` says where ART logs the
    metrics (art-sky returns them to ART, which logs them); anything else is refused by name."""
    unknown = sorted(set(dev_config or {}) - {"metric_logging"})
    if unknown:
        raise ConfigError(f"train_sft's experimental config {unknown} is not supported by art-sky: leave it out")
    batch_size = getattr(config, "batch_size", "auto")
    rate = getattr(config, "learning_rate", 5e-5)
    turns = getattr(config, "assistant_turns", "all")
    if turns not in ("all", "last"):
        raise ConfigError(f"TrainSFTConfig.assistant_turns={turns!r}: 'all' or 'last', as ART takes it")
    rates = list(rate) if isinstance(rate, list) else [rate]
    return (2 if batch_size == "auto" else int(batch_size)), rates, cast(Literal["all", "last"], turns)  # checked above
