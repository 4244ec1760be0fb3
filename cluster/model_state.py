"""One registered model on the server: base weights, the trainable LoRA, its optimizer, tokenizer, step and
checkpoints.

A checkpoint holds everything the next step depends on: the LoRA (loadable by vLLM and PEFT on its own), the
optimizer's state (AdamW's moments and step counts) and the step's record (cluster/steps.py commits them together;
cluster/checkpoint_writer.py writes them, in the background once staged).
There is no learning-rate scheduler (the rate comes with each train call, as in ART) and no random state to carry:
each step seeds its generators from the step number (cluster/steps.py), so a resumed run draws what the straight run
would have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from art_sky.checkpoints import CheckpointDir, CorruptCheckpointError, StepRecord, verify
from art_sky.errors import CheckpointStoreError, ConfigError
from art_sky.settings import Settings
from art_sky.store import CheckpointStore
from art_sky.wire import ModelConfig, ModelInfo, RegisterRequest

from .checkpoint_writer import CheckpointWriter, Staged
from .tiny_model import TINY_MODEL_NAME, tiny_model_path
from .training import weights as lora
from .training.packing import use_packed_attention
from .training.weights import ADAPTER, make_optimizer

log = logging.getLogger("art_sky.cluster")

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_SEED = 0  # a fresh LoRA's initial weights: the same for every registration of the same config (Unsloth's too)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_base_model(base_model: str, settings: Settings) -> str:
    """`art-sky/tiny`, a local Hugging Face model directory, or a hub id (needs internet on the node)."""
    if base_model == TINY_MODEL_NAME:
        return str(tiny_model_path(settings.cache_dir))
    return base_model


def load_base(base_model: str, settings: Settings) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_base_model(base_model, settings)
    dtype = torch.bfloat16 if device().type == "cuda" else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        # transformers' `to` is a functools.wraps of torch's, which mypy does not bind as a method
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device())  # type: ignore[arg-type]
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot load base model {base_model!r}: {exc}. Use {TINY_MODEL_NAME!r}, a local Hugging Face model "
            "directory, or a hub id on a node with internet access"
        ) from exc
    if tokenizer.chat_template is None:
        raise ConfigError(f"base model {base_model!r} has no chat template; art-sky trains chat models")
    use_packed_attention(model)
    return model, tokenizer


class TrainedWeights(Protocol):
    """Where a model's trainable LoRA and its AdamW live: in this process (`LocalWeights`) or sharded over the
    trainer's ranks (cluster/training/rank_group.py). A step (cluster/steps.py) snapshots them, trains, stages them
    for the step's checkpoint, or puts the snapshot back."""

    def snapshot(self) -> Any: ...

    def restore(self, saved: Any) -> None: ...

    def stage(self, optimizer: bool = True) -> Staged:
        """What the step's checkpoint holds, captured now, written later: the adapter (PEFT's layout, which vLLM
        loads) and, with `optimizer`, the optimizer's state."""


@dataclass
class ModelState:
    request: RegisterRequest
    model: Any  # peft.PeftModel
    tokenizer: Any
    checkpoints: CheckpointDir
    step: int = 0
    restored_from: str | None = None
    optimizer: torch.optim.Optimizer | None = None
    requests: dict[str, int] = field(default_factory=dict)  # recent request ids -> the step each trained
    leases: dict[str, int] = field(default_factory=dict)  # held adapter leases (ART's) -> the step each pins
    # the trainer's; this process's LoRA by default (None only until __post_init__ makes it)
    weights: TrainedWeights = None  # type: ignore[assignment]
    # writes before returning unless told otherwise (None only until __post_init__ makes it)
    writer: CheckpointWriter = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.weights is None:
            self.weights = LocalWeights(self)
        if self.writer is None:
            self.writer = CheckpointWriter(self.checkpoints, self.request.base_model, background=False)

    @property
    def name(self) -> str:
        """What the run is served and addressed under (its model name, or `name:run`: cluster/runs.py)."""
        return self.request.served

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        return {i for i in ids if i is not None} | {self.tokenizer.eos_token_id}

    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.request.name,
            project=self.request.project,
            base_model=self.request.base_model,
            step=self.step,
            run_name=self.request.run_name,
            served=self.name,
            restored_from=self.restored_from,
        )

    def save_checkpoint(self, record: StepRecord, metrics: dict[str, float] | None = None) -> Path:
        """Write step `record.step` whole (LoRA, optimizer state, record, manifest) or not at all, before returning
        (a registration's step 0); the model's step is not changed here."""
        self.writer.write_now(record, self.weights.stage(optimizer=record.saved), metrics)
        return self.checkpoints.step_dir(record.step)

    def commit_checkpoint(self, record: StepRecord, metrics: dict[str, float] | None = None) -> None:
        """A trained step's checkpoint: once the previous step is on disk, staged now and written in the background
        (or now); raises when it cannot be (the step rolls back). The model's step is not changed here
        (cluster/steps.py commits)."""
        self.writer.flush()
        self.writer.commit(record, self.weights.stage(optimizer=record.saved), metrics)

    def adapter_dir(self, step: int) -> Path:
        """Where an engine loads step `step`'s adapter from (cluster/checkpoint_writer.py)."""
        return self.writer.adapter_dir(step)

    def record(self, step: int) -> StepRecord | None:
        """The step's record, on disk or being written."""
        return self.writer.record(step)


class LocalWeights:
    """The LoRA and AdamW of the model this process trains (the PEFT and Unsloth trainers)."""

    def __init__(self, state: ModelState):
        self.state = state

    @classmethod
    def load(cls, state: ModelState, step_dir: Path | None) -> LocalWeights:
        """The model's optimizer, with the state saved at `step_dir` if there is one."""
        optimizer = ensure_optimizer(state)
        saved = lora.read_optimizer(step_dir) if step_dir is not None else None
        if saved is not None:
            lora.load_optimizer(state.model, optimizer, saved)
        elif state.step > 0:
            log.warning(
                "step %d of %s has no optimizer state: training resumes with fresh AdamW moments",
                state.step,
                state.name,
            )
        return cls(state)

    def snapshot(self) -> lora.Snapshot:
        return lora.snapshot(self.state.model, ensure_optimizer(self.state))

    def restore(self, saved: lora.Snapshot) -> None:
        lora.restore(self.state.model, ensure_optimizer(self.state), saved)

    def stage(self, optimizer: bool = True) -> lora.Staged:
        return lora.stage(self.state.model, ensure_optimizer(self.state) if optimizer else None)

    def save(self, directory: Path, optimizer: bool = True) -> None:
        self.stage(optimizer).write(directory)


def ensure_optimizer(state: ModelState) -> torch.optim.Optimizer:
    """The model's AdamW (made with the model, restored with its checkpoint; here for a state built without one),
    kept with its moments across steps."""
    if state.optimizer is None:
        state.optimizer = make_optimizer(state.model)
    return state.optimizer


Loader = Callable[[RegisterRequest, Settings, Path | None], tuple[Any, Any]]
WeightsLoader = Callable[[ModelState, Path | None], TrainedWeights]  # the trainer's: its weights from a step dir


def load_peft(request: RegisterRequest, settings: Settings, checkpoint: Path | None) -> tuple[Any, Any]:
    """The base model with the LoRA saved at `checkpoint`, or a fresh LoRA: (peft model, tokenizer)."""
    from peft import PeftModel, get_peft_model

    base, tokenizer = load_base(request.base_model, settings)
    if checkpoint is not None:
        return PeftModel.from_pretrained(base, checkpoint, adapter_name=ADAPTER, is_trainable=True), tokenizer
    with torch.random.fork_rng(devices=[]):  # the server's other random draws are left alone
        torch.manual_seed(LORA_SEED)
        return get_peft_model(base, lora_config(request.config), adapter_name=ADAPTER), tokenizer


def load_shape(request: RegisterRequest, settings: Settings) -> tuple[Any, Any]:
    """The base model's shape (on the meta device: no memory) and its tokenizer, for a process that renders
    prompts and reads the model's config but samples and trains elsewhere (vLLM, the trainer's ranks)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source = resolve_base_model(request.base_model, settings)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load base model {request.base_model!r}: {exc}") from exc
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass  # the config's own
    return model, tokenizer


def lora_config(cfg: ModelConfig) -> Any:
    """A fresh LoRA's PEFT config from the model's settings."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules or DEFAULT_TARGET_MODULES,
        task_type="CAUSAL_LM",
    )


def create_model_state(
    request: RegisterRequest,
    art_path: Path,
    settings: Settings,
    load: Loader = load_peft,
    downloaded: tuple[int, str] | None = None,
    load_weights: WeightsLoader = LocalWeights.load,
) -> ModelState:
    """The newest intact checkpoint of this model if there is one (weights, optimizer state, recent request ids),
    else a fresh LoRA (saved as step 0). Steps trained with save_checkpoint=False are not resume points: those
    after the restored step are removed, and their history lines moved aside (training goes on from the
    checkpoint, so the step numbers after it are trained again).

    `load` is the trainer's: it builds the model the trainer can train (PEFT, or Unsloth's patched model), and
    `load_weights` its trainable state (in this process, or on the trainer's ranks).
    `downloaded`: (step, its URI) when `restore_from_store` just fetched that step, so the model says where from.
    What a save or download killed mid-way left is removed first.
    """
    checkpoints = CheckpointDir(art_path, request.project, request.run)
    for stale in checkpoints.remove_stale_temps():
        log.info("removed %s, left by a save or download that did not finish", stale)
    unsaved: list[int] = []
    for step in reversed(checkpoints.steps()):
        manifest = checkpoints.manifest(step)
        assert manifest is not None  # steps() lists only the steps with a readable manifest
        if manifest.base_model != request.base_model:
            raise ConfigError(
                f"model {request.name!r} of project {request.project!r} was trained from {manifest.base_model!r}, "
                f"not {request.base_model!r}: pick another model name or the same base model"
            )
        try:
            verify(checkpoints.step_dir(step), manifest)
        except CorruptCheckpointError as exc:
            log.warning("skipping step %d: %s", step, exc)
            continue
        record = checkpoints.record(step)
        if record is not None and not record.saved:
            unsaved.append(step)
            continue
        _drop_unsaved(checkpoints, unsaved, step)
        model, tokenizer = load(request, settings, checkpoints.step_dir(step))
        origin = downloaded[1] if downloaded and downloaded[0] == step else checkpoints.step_dir(step)
        state = ModelState(request, model, tokenizer, checkpoints, step=step, restored_from=str(origin))
        state.writer.background = settings.checkpoint_background
        state.weights = load_weights(state, checkpoints.step_dir(step))
        state.requests = dict(record.requests) if record else {}
        _complete_history(state)
        log.info("model %s restored at step %d", request.name, step)
        break
    else:
        _drop_unsaved(checkpoints, unsaved, 0)
        model, tokenizer = load(request, settings, None)
        state = ModelState(request, model, tokenizer, checkpoints)
        state.writer.background = settings.checkpoint_background
        state.weights = load_weights(state, None)
        state.save_checkpoint(StepRecord(step=0, kind="init", request_id=request.request_id))
    state.model.eval()
    return state


def _drop_unsaved(checkpoints: CheckpointDir, unsaved: list[int], restored: int) -> None:
    """Steps trained with save_checkpoint=False after the checkpoint training resumes from: their directories go, and
    their history lines move to history.unsaved.jsonl (the steps are trained again under the same numbers)."""
    if not unsaved:
        return
    checkpoints.delete(unsaved)
    moved = checkpoints.set_history_aside(after=restored)
    log.warning(
        "%s: steps %s were trained with save_checkpoint=False and are lost with the server that trained them: "
        "training resumes from step %d (%d history lines moved to history.unsaved.jsonl)",
        checkpoints.name,
        sorted(unsaved),
        restored,
        moved,
    )


def _complete_history(state: ModelState) -> None:
    """A step commits with its history line in its record; history.jsonl gets the line just after (with the step's
    timing added). A server killed between the two left the line out: it is added now, once. Lines that earlier
    servers wrote twice are removed, the first of each kept."""
    removed = state.checkpoints.remove_duplicate_history()
    if removed:
        log.warning(
            "history of %s: removed %d line(s) written twice by earlier restarts; the first of each kept",
            state.name,
            removed,
        )
    record = state.checkpoints.record(state.step)
    if record is not None and record.history is not None and not state.checkpoints.has_step_line(record):
        state.checkpoints.append_history(record.history)
        log.info("history of %s: added step %d's line, which a stopped server had not written", state.name, state.step)


async def restore_from_store(
    store: CheckpointStore, checkpoints: CheckpointDir, strict: bool
) -> tuple[int, str] | None:
    """On a cluster without local checkpoints of this model, download the newest verified step from the store, on
    the server's event loop: (step, its URI), or None when nothing was downloaded.

    A store that cannot be read is a warning (training starts from what is local) unless in strict mode.
    """
    if checkpoints.steps():
        return None
    try:
        step = await store.restore(checkpoints)
    except CheckpointStoreError as exc:
        if strict:
            raise
        log.warning("not restoring %s from the checkpoint store: %s", checkpoints.name, exc)
        return None
    if step is None:
        return None
    where = store.where(checkpoints.project, checkpoints.name, step)
    log.info("downloaded step %d of %s from %s", step, checkpoints.name, where)
    return step, where
