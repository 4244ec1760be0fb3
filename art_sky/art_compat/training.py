"""ART's `backend.train(model, groups, **keywords)`: every keyword of ART's LocalBackend.train, per release line,
mapped to art-sky's trainer (`TrainConfig`), to the step (`save_checkpoint`), accepted where it cannot change what
is trained, or refused by name with the release that introduced it and what to do. A keyword no supported release
has is a TypeError listing the accepted ones, as Python would raise it.

And `TrainResult`: what `backend.train` returns, an `art.LocalTrainResult` (so `isinstance(result,
art.TrainResult)` holds) when openpipe-art is installed, with art-sky's `totals` beside ART's fields.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from art_sky.errors import ConfigError, first_problem
from art_sky.wire import TrainConfig

Role = Literal["config", "step", "accepted", "default"]


@dataclass(frozen=True)
class Keyword:
    """One keyword of ART's `backend.train`: the release that added it, ART's default, and what art-sky does with
    it: maps it into TrainConfig (`config`), applies it to the step (`step`), accepts any value because it cannot
    change what is trained (`accepted`, `why` says so), or takes only ART's default (`default`, `why` says why)."""

    since: str
    default: Any
    role: Role
    why: str = ""


KEYWORDS: dict[str, Keyword] = {
    "learning_rate": Keyword("0.5.18", 5e-6, "config"),
    "loss_fn": Keyword("0.5.18", "cispo", "config"),
    "loss_fn_config": Keyword("0.5.18", None, "default", "art-sky's losses take no extra config"),
    "normalize_advantages": Keyword("0.5.18", True, "config"),
    "adam_params": Keyword("0.5.18", None, "default", "the optimizer is AdamW with the learning rate you pass"),
    "kl_penalty_coef": Keyword("0.5.18", 0.0, "config"),
    "kl_penalty_reference_step": Keyword(
        "0.5.18",
        None,
        "config",
        "the KL reference is the base model, which is step 0 (a fresh LoRA changes nothing): leave it None or 0",
    ),
    "kl_ref_adapter_path": Keyword("0.5.18", None, "default", "the KL reference is the base model"),
    "kl_penalty_source": Keyword("0.5.20", "current_learner", "config"),
    "epsilon": Keyword("0.5.18", None, "config"),
    "epsilon_high": Keyword("0.5.18", None, "config"),
    "advantage_balance": Keyword("0.5.18", 0.0, "default", "advantages are (reward - mean) / std per group"),
    "scale_rewards": Keyword("0.5.18", True, "config"),
    "importance_sampling_level": Keyword("0.5.18", "token", "config"),
    "max_negative_advantage_importance_sampling_weight": Keyword(
        "0.5.18", None, "default", "ratios are clipped by epsilon/epsilon_high only"
    ),
    "mask_prob_ratio": Keyword("0.5.18", False, "default", "ratios are clipped, not masked"),
    "kimi_k2_tau": Keyword("0.5.18", None, "default", "not implemented"),
    "precalculate_logprobs": Keyword("0.5.18", False, "config"),
    "allow_training_without_logprobs": Keyword("0.5.18", False, "config"),
    "plot_tensors": Keyword("0.5.18", False, "default", "not implemented"),
    "truncated_importance_sampling": Keyword("0.5.18", None, "config"),
    "scale_learning_rate_by_reward_std_dev": Keyword("0.5.18", False, "default", "the learning rate is used as given"),
    "logprob_calculation_chunk_size": Keyword(
        "0.5.18", 1024, "accepted", "memory is bounded by ART_SKY_TRAIN_MICROBATCH_TOKENS on the server"
    ),
    "packed_sequence_length": Keyword(
        "0.5.18", None, "accepted", "memory is bounded by ART_SKY_TRAIN_MICROBATCH_TOKENS on the server"
    ),
    "num_trajectories_learning_rate_multiplier_power": Keyword(
        "0.5.18", 0.0, "default", "the learning rate is used as given"
    ),
    "save_checkpoint": Keyword("0.5.18", True, "step"),
    "optimizer_save_interval": Keyword(
        "0.5.20", 5, "accepted", "every checkpoint art-sky writes holds the optimizer state (an exact resume)"
    ),
    "final_training_step": Keyword(
        "0.5.20", None, "accepted", "every checkpoint art-sky writes holds the optimizer state (an exact resume)"
    ),
    "grad_accumulation_sequences": Keyword("0.5.20", None, "config"),
}

# ART's defaults per loss: CISPO clips the (detached) ratio to [1 - 1, 1 + 4], PPO's is 0.2 both ways.
_EPSILONS = {"cispo": (1.0, 4.0), "ppo": (0.2, None)}


@dataclass
class StepOptions:
    """What a train call asks of the step besides the loss: whether its checkpoint is written."""

    save_checkpoint: bool = True


def train_options(config: TrainConfig | None, kwargs: dict[str, Any]) -> tuple[TrainConfig, StepOptions]:
    """ART's `backend.train` keywords (or art-sky's `config=TrainConfig(...)`, which they then amend) as the
    step's TrainConfig and options. Without `config`, ART's defaults apply (loss_fn "cispo", learning rate 5e-6)."""
    for name, value in kwargs.items():
        _check(name, value)
    given = {name: value for name, value in kwargs.items() if KEYWORDS[name].role == "config"}
    # A keyword named as a TrainConfig field is that field; the three below are translated.
    values: dict[str, Any] = {
        name: value for name, value in given.items() if value is not None and name in TrainConfig.model_fields
    }
    if given.get("normalize_advantages") is False:
        values["scale_rewards"] = False
    if given.get("precalculate_logprobs"):
        values["old_logprobs"] = "trainer"
    if config is not None:
        base = config.model_dump()
    else:
        low, high = _EPSILONS.get(values.get("loss_fn", "cispo"), (0.2, None))
        base = {"loss_fn": "cispo", "epsilon": low, "epsilon_high": high}
    try:
        merged = TrainConfig(**base | values)
    except ValidationError as exc:
        where, wrong = first_problem(exc)
        given_value = f"={kwargs[where]!r}" if where in kwargs else "=..." if where else ""
        raise ConfigError(f"backend.train({where}{given_value}): {wrong}") from exc
    return merged, StepOptions(save_checkpoint=bool(kwargs.get("save_checkpoint", True)))


def _check(name: str, value: Any) -> None:
    keyword = KEYWORDS.get(name)
    if keyword is None:
        raise TypeError(
            f"backend.train() got an unexpected keyword argument {name!r}: art-sky takes the keywords "
            f"of ART's LocalBackend.train ({', '.join(sorted(KEYWORDS))}) or config=TrainConfig(...)"
        )
    if keyword.role == "default" and value != keyword.default:
        raise ConfigError(
            f"backend.train({name}={value!r}) is not supported by art-sky's trainer ({keyword.why}); "
            f"ART {keyword.since} added {name}: leave it at {keyword.default!r}"
        )
    if name == "kl_penalty_reference_step" and value not in (None, 0):
        raise ConfigError(
            f"backend.train(kl_penalty_reference_step={value!r}) is not supported by art-sky's trainer ({keyword.why})"
        )
    if name in ("optimizer_save_interval", "logprob_calculation_chunk_size") and (
        not isinstance(value, int) or value < 1
    ):
        raise ConfigError(f"backend.train({name}={value!r}): a positive integer, as ART takes it")
    if (
        name in ("final_training_step", "packed_sequence_length")
        and value is not None
        and (not isinstance(value, int) or value < 1)
    ):
        raise ConfigError(f"backend.train({name}={value!r}): None or a positive integer, as ART takes it")
    if name == "save_checkpoint" and not isinstance(value, bool):
        raise ConfigError(f"backend.train(save_checkpoint={value!r}): True or False")


@dataclass
class TrainResult:
    """What `backend.train(model, groups, ...)` returns, with ART's fields: the step after training, the step's
    metrics and its checkpoint's path on the machine that runs the server (None when `save_checkpoint=False`);
    and art-sky's `totals`, the run's cumulative figures (`costs/cum/gpu`), kept apart because ART's
    `model.log(metrics=...)` computes its own cumulative keys and refuses given ones."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint_path: str | None = None
    totals: dict[str, float] = field(default_factory=dict)
    # ART 0.5.20's: awaited, the checkpoint is on disk (ART writes it after train() returns; art-sky's server
    # answers once it is on disk, so this is at once); None where `checkpoint_path` is not on this machine
    checkpoint_ready: Awaitable[None] | None = field(default=None, repr=False, compare=False)


class Ready:
    """An awaitable that runs `wait()` when awaited, and nothing otherwise (a coroutine made in advance and never
    awaited would warn)."""

    def __init__(self, wait: Callable[[], Awaitable[Any]]):
        self._wait = wait

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()


def train_result(
    step: int,
    metrics: dict[str, float],
    checkpoint_path: str | None = None,
    totals: dict[str, float] | None = None,
    checkpoint_ready: Awaitable[None] | None = None,
) -> TrainResult:
    """A TrainResult; an instance of ART's own result class too in a program that imported openpipe-art."""
    art = sys.modules.get("art")
    local = getattr(art, "LocalTrainResult", None) if art is not None else None
    kind = _subclass_of(local) if isinstance(local, type) else TrainResult
    return kind(
        step=step,
        metrics=metrics,
        checkpoint_path=checkpoint_path,
        totals=totals or {},
        checkpoint_ready=checkpoint_ready,
    )


@functools.cache
def _subclass_of(local: type) -> type:
    """art-sky's TrainResult that is also ART's `LocalTrainResult` (both dataclasses: their fields merge)."""

    @dataclass
    class ArtTrainResult(local, TrainResult):
        __doc__ = TrainResult.__doc__

    ArtTrainResult.__name__ = ArtTrainResult.__qualname__ = "TrainResult"
    return ArtTrainResult
