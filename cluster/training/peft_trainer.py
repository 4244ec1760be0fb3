"""The portable GRPO trainer: PEFT LoRA on any device, gradient accumulation over micro-batches.

One `train()` call is one optimizer step over every trained token of the batch (mean over trained tokens), however
many micro-batches it takes to fit in memory. A micro-batch is packed (no padding, cluster/training/packing.py), the
LM head scores only its trained tokens without float32 logits (cluster/training/lm_head.py), and its activations are
recomputed in the backward pass only when they would not fit otherwise (ART_SKY_ACTIVATION_CHECKPOINTING). The
sharded ranks (cluster/training/sharded.py) and the Unsloth trainer run this same step.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from art_sky.settings import Settings
from art_sky.wire import RegisterRequest, TrainConfig

from ..model_state import LocalWeights, ModelState, TrainedWeights, device, ensure_optimizer, load_peft
from ..node.placement import base_parameters
from . import packing
from .activations import activations_fit, refuse_unfit, set_checkpointing
from .grpo import grpo_loss_sums
from .lm_head import full_logprobs, fused_head, head_weight, hidden_states, token_logprobs
from .sequences import Sequence
from .weights import trainable

Progress = Callable[[int, int], None]


@dataclass
class Policy:
    """What a step trains: the model, its optimizer, and the id rows are padded with. On a sharded rank the model's
    parameters are its shards, `reduce` sums a tensor over every rank, and `last` marks the backward pass whose
    gradients are synchronised (the ranks' FSDP hook, `set_requires_gradient_sync`)."""

    model: Any
    optimizer: torch.optim.Optimizer
    pad_id: int
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor
    last: Callable[[bool], None] = lambda is_last: None


class PeftTrainer:
    name = "peft"
    ranks = 1
    rendezvous = None  # one process: no other node's ranks meet it (ShardedTrainer's says where they do)

    def __init__(self, microbatch_tokens: int, activation_checkpointing: str = "auto"):
        self.microbatch_tokens = microbatch_tokens
        self.activation_checkpointing = activation_checkpointing

    def close(self) -> None:
        """Nothing runs beside the server."""

    def load_model(self, request: RegisterRequest, settings: Settings, checkpoint: Path | None) -> tuple[Any, Any]:
        """The model this trainer trains, (peft model, tokenizer): transformers plus a PEFT LoRA; refused when its
        longest sequence cannot train on this GPU."""
        model, tokenizer = load_peft(request, settings, checkpoint)
        self.refuse_unfit(request, model)
        return model, tokenizer

    def refuse_unfit(self, request: RegisterRequest, model: Any) -> None:
        if device().type == "cuda":
            total = torch.cuda.get_device_properties(device()).total_memory
            refuse_unfit(
                request, model, base_parameters(model), 1, total, self.microbatch_tokens, self.activation_checkpointing
            )

    def load_weights(self, state: ModelState, step_dir: Path | None) -> TrainedWeights:
        """The model's LoRA and AdamW, trained in this process."""
        return LocalWeights.load(state, step_dir)

    def train(
        self,
        state: ModelState,
        sequences: list[Sequence],
        config: TrainConfig,
        progress: Progress = lambda done, total: None,
    ) -> dict[str, float]:
        """Blocking: run it off the event loop, under the server's model lock."""
        policy = Policy(state.model, ensure_optimizer(state), pad_id(state.tokenizer))
        return self.grpo_step(
            policy,
            self.microbatches(sequences, self.packs(state.model)),
            sum(s.trained_tokens for s in sequences),
            len(sequences),
            config,
            progress,
        )

    def grpo_step(
        self,
        policy: Policy,
        batches: list[list[Sequence]],
        total_tokens: int,
        rows: int,
        config: TrainConfig,
        progress: Progress = lambda done, total: None,
    ) -> dict[str, float]:
        """One optimizer step over `batches` (this process's micro-batches; a rank's share on ranks), the loss
        divided by the step's `total_tokens` on every process, so the summed gradients are the whole step's."""
        model, optimizer = policy.model, policy.optimizer
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate
        measured_kl = config.beta > 0 or config.kl_penalty_coef > 0  # a reference pass runs only then
        sums = torch.zeros(4, device=device())  # policy, kl, clipped, entropy: summed on the device, read once
        model.train()
        try:
            with _lora_inputs_kept(model):
                for done, batch in enumerate(batches, start=1):
                    policy.last(done == len(batches))
                    parts, entropy = self._loss(policy, batch, config)
                    loss = (parts.policy + config.beta * parts.kl) / total_tokens
                    loss.backward()
                    sums += torch.stack([parts.policy, parts.kl, parts.clipped, entropy]).detach()
                    progress(done, len(batches))
            grad_norm = _full(torch.nn.utils.clip_grad_norm_(trainable(model), config.max_grad_norm))
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
            model.eval()
        policy_loss, kl, clipped, entropy = (policy.reduce(sums) / total_tokens).tolist()
        return {
            "loss": policy_loss + config.beta * kl,
            "policy_loss": policy_loss,
            **({"kl": kl} if measured_kl else {}),
            "entropy": entropy,
            "clip_fraction": clipped,
            "grad_norm": float(grad_norm),
            "learning_rate": config.learning_rate,
            "trained_tokens": float(total_tokens),
            "sequences": float(rows),
        }

    def microbatches(self, sequences: list[Sequence], packed: bool) -> list[list[Sequence]]:
        """Sequences sorted by length, grouped so that a micro-batch's tokens stay within the budget: their sum when
        `packed`, rows x longest when padded. A sequence longer than the budget is a micro-batch of its own."""
        batches: list[list[Sequence]] = []
        for seq in sorted(sequences, key=lambda s: len(s.token_ids)):
            current = batches[-1] if batches else None
            if current and _tokens([*current, seq], packed) <= self.microbatch_tokens:
                current.append(seq)
            else:
                batches.append([seq])
        return batches

    def packs(self, model: Any) -> bool:
        """Does this trainer pack `model`'s micro-batches (its attention reads packed rows)?"""
        return packing.packs(model, self._logits)

    def sft(
        self,
        state: ModelState,
        batches: list[list[Sequence]],
        learning_rates: list[float],
        max_grad_norm: float,
        progress: Progress = lambda done, total: None,
    ) -> list[dict[str, float]]:
        """ART's SFT: per batch, one optimizer step on the mean next-token loss of its trained tokens (the
        assistant turns), micro-batched like `train`. Returns each batch's metrics. Blocking, under the lock."""
        policy = Policy(state.model, ensure_optimizer(state), pad_id(state.tokenizer))
        packed = self.packs(state.model)
        shares = [
            (self.microbatches(batch, packed), sum(s.trained_tokens for s in batch), len(batch)) for batch in batches
        ]
        return self.sft_steps(policy, shares, learning_rates, max_grad_norm, progress)

    def sft_steps(
        self,
        policy: Policy,
        shares: list[tuple[list[list[Sequence]], int, int]],
        learning_rates: list[float],
        max_grad_norm: float,
        progress: Progress = lambda done, total: None,
    ) -> list[dict[str, float]]:
        """One optimizer step per batch: (its micro-batches here, its trained tokens, its rows) and a rate each."""
        model, optimizer = policy.model, policy.optimizer
        results = []
        model.train()
        try:
            for done, ((micro, tokens, rows), lr) in enumerate(zip(shares, learning_rates, strict=False), start=1):
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device())
                with _lora_inputs_kept(model):
                    for index, batch in enumerate(micro, start=1):
                        policy.last(index == len(micro))
                        new, _ = self._scores(policy, self._layout(policy, batch))
                        nll = -(new * _trained(batch)).sum()
                        (nll / tokens).backward()
                        loss_sum += nll.detach()
                grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(trainable(model), max_grad_norm)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                results.append(
                    {
                        "loss": float(policy.reduce(loss_sum)) / tokens,
                        "grad_norm": grad_norm,
                        "learning_rate": lr,
                        "trained_tokens": float(tokens),
                        "sequences": float(rows),
                    }
                )
                progress(done, len(shares))
        finally:
            optimizer.zero_grad(set_to_none=True)
            model.eval()
        return results

    def _layout(self, policy: Policy, batch: list[Sequence]) -> packing.Layout:
        return packing.layout(batch, policy.pad_id, self.packs(policy.model), device())

    def _scores(self, policy: Policy, layout: packing.Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """The new logprob and the policy's entropy at each trained token of the micro-batch, [rows, longest - 1]
        (shifted by one token; 0 where nothing is trained). The LM head scores only the trained tokens: fused
        (no float32 logits) where it computes the model's logits, else the model's own logits at those positions."""
        model = policy.model
        self._checkpointing(model, layout.inputs["input_ids"].numel())
        if self.fuses_head(model):
            hidden = self._hidden(model, layout.inputs)
            picked = hidden.reshape(-1, hidden.shape[-1])[layout.select]
            logprobs, entropies = token_logprobs(picked, head_weight(model), layout.targets)
        else:
            logits = self._logits(model, layout.inputs)
            logprobs, entropies = full_logprobs(logits.reshape(-1, logits.shape[-1])[layout.select], layout.targets)
        return layout.per_row(logprobs), layout.per_row(entropies)

    def fuses_head(self, model: Any) -> bool:
        """Does the fused LM head compute `model`'s logits (cluster/training/lm_head.py)?"""
        return fused_head(
            model,
            lambda m, ids: self._hidden(m, {"input_ids": ids, "use_cache": False}),
            lambda m, ids: self._logits(m, {"input_ids": ids, "use_cache": False}),
        )

    def _logits(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        with bf16_compute(model):
            return model(**inputs).logits

    def _hidden(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """The model's final hidden states (after its last norm), [rows, tokens, hidden size]."""
        with hidden_states(model), bf16_compute(model):
            return model(**inputs).logits

    def _checkpointing(self, model: Any, tokens: int) -> None:
        """Activation checkpointing for the next forward: as set, or with `auto` only where its activations would
        not fit the device's free memory (cluster/training/activations.py)."""
        setting = self.activation_checkpointing
        on = setting == "on" or (setting == "auto" and model.training and not activations_fit(model, tokens))
        set_checkpointing(model, on)

    def _loss(self, policy: Policy, batch: list[Sequence], config: TrainConfig):
        """The micro-batch's loss sums and the summed entropy of the policy over its trained tokens."""
        dev = device()
        layout = self._layout(policy, batch)
        new, entropies = self._scores(policy, layout)
        trained = _trained(batch)
        old = _padded([s.old_logprobs for s in batch], float("nan"))[:, 1:]
        advantages = torch.tensor([[s.advantage] for s in batch], device=dev)
        ref = None
        if config.beta > 0 or config.kl_penalty_coef > 0:
            with torch.no_grad(), policy.model.disable_adapter():
                ref, _ = self._scores(policy, layout)
        parts = grpo_loss_sums(
            new,
            old,
            advantages,
            trained,
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high or config.epsilon,
            ref_logprobs=ref,
            loss_fn=config.loss_fn,
            kl_penalty_coef=config.kl_penalty_coef,
            kl_penalty_source=config.kl_penalty_source,
            importance_sampling_level=config.importance_sampling_level,
            old_policy=config.old_logprobs,
            truncated_importance_sampling=config.truncated_importance_sampling,
        )
        return parts, (entropies * trained).sum()


def bf16_compute(model: Any):
    """On CUDA with a bf16 base model, the forward's matmuls in bf16, the LoRA's too (its fp32 weights cast per op),
    as FSDP2's mixed precision runs them on the ranks; PEFT alone runs each LoRA matmul in fp32, on an fp32 copy of
    its input."""
    if device().type == "cuda" and model.get_input_embeddings().weight.dtype == torch.bfloat16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def _lora_inputs_kept(model: Any):
    """For a whole step (its forwards, and the recomputes of activation checkpointing in its backward passes): PEFT
    does not copy each LoRA input to fp32 where autocast runs the LoRA in bf16 anyway (`bf16_compute`)."""
    try:
        from peft.helpers import disable_input_dtype_casting
    except ImportError:  # PEFT before 0.15 always copies: autocast still runs the LoRA in bf16
        return nullcontext()
    return disable_input_dtype_casting(model, active=not isinstance(bf16_compute(model), nullcontext))


def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id or 0


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm: on ranks `clip_grad_norm_` returns it as a sharded tensor of the whole norm."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _padded(rows: list[list], fill) -> torch.Tensor:
    """Right-padded to the longest row, on the training device."""
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], device=device())


def _trained(batch: list[Sequence]) -> torch.Tensor:
    """Which positions predict a trained token, [rows, longest - 1]."""
    return _padded([s.trained for s in batch], False)[:, 1:]


def _tokens(batch: list[Sequence], packed: bool) -> int:
    """What a micro-batch holds in the model: its tokens, or with padding rows x longest."""
    lengths = [len(s.token_ids) for s in batch]
    return sum(lengths) if packed else len(lengths) * max(lengths)
