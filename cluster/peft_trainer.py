"""The portable GRPO trainer: PEFT LoRA on any device, gradient accumulation over micro-batches.

One `train()` call is one optimizer step over every trained token of the batch (mean over trained tokens), however
many micro-batches it takes to fit in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from art_sky.settings import Settings
from art_sky.wire import RegisterRequest, TrainConfig

from .grpo import grpo_loss_sums
from .model_state import ModelState, device, load_peft
from .sequences import Sequence

Progress = Callable[[int, int], None]


class PeftTrainer:
    name = "peft"

    def __init__(self, microbatch_tokens: int):
        self.microbatch_tokens = microbatch_tokens

    def load_model(self, request: RegisterRequest, settings: Settings, checkpoint: Path | None) -> tuple[Any, Any]:
        """The model this trainer trains, (peft model, tokenizer): transformers plus a PEFT LoRA."""
        return load_peft(request, settings, checkpoint)

    def train(self, state: ModelState, sequences: list[Sequence], config: TrainConfig,
              progress: Progress = lambda done, total: None) -> dict[str, float]:
        """Blocking: run it off the event loop, under the server's model lock."""
        model = state.model
        optimizer = _optimizer(state)
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate
        total_tokens = sum(s.trained_tokens for s in sequences)
        batches = self._microbatches(sequences)
        sums = {"policy": 0.0, "kl": 0.0, "clipped": 0.0}
        model.train()
        try:
            for done, batch in enumerate(batches, start=1):
                parts = self._loss(state, batch, config)
                loss = (parts.policy + config.beta * parts.kl) / total_tokens
                loss.backward()
                sums["policy"] += float(parts.policy.detach())
                sums["kl"] += float(parts.kl.detach())
                sums["clipped"] += float(parts.clipped.detach())
                progress(done, len(batches))
            trainable = [p for group in state.optimizer.param_groups for p in group["params"]]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm))
            state.optimizer.step()
        finally:
            state.optimizer.zero_grad(set_to_none=True)
            model.eval()
        return {
            "loss": (sums["policy"] + config.beta * sums["kl"]) / total_tokens,
            "policy_loss": sums["policy"] / total_tokens,
            "kl": sums["kl"] / total_tokens,
            "clip_fraction": sums["clipped"] / total_tokens,
            "grad_norm": grad_norm,
            "trained_tokens": float(total_tokens),
            "sequences": float(len(sequences)),
        }

    def _microbatches(self, sequences: list[Sequence]) -> list[list[Sequence]]:
        """Sequences sorted by length, packed so that (rows x longest) stays within the token budget."""
        batches: list[list[Sequence]] = []
        for seq in sorted(sequences, key=lambda s: len(s.token_ids)):
            current = batches[-1] if batches else None
            if current and (len(current) + 1) * len(seq.token_ids) <= self.microbatch_tokens:
                current.append(seq)
            else:
                batches.append([seq])
        return batches

    def sft(self, state: ModelState, batches: list[list[Sequence]], learning_rates: list[float],
            max_grad_norm: float, progress: Progress = lambda done, total: None) -> list[dict[str, float]]:
        """ART's SFT: per batch, one optimizer step on the mean next-token loss of its trained tokens (the
        assistant turns), micro-batched like `train`. Returns each batch's metrics. Blocking, under the lock."""
        model = state.model
        optimizer = _optimizer(state)
        trainable = [p for group in optimizer.param_groups for p in group["params"]]
        results = []
        model.train()
        try:
            for done, (batch, lr) in enumerate(zip(batches, learning_rates), start=1):
                for group in optimizer.param_groups:
                    group["lr"] = lr
                tokens = sum(s.trained_tokens for s in batch)
                loss_sum = 0.0
                for micro in self._microbatches(batch):
                    new, trained, _, _ = self._logprobs(state, micro)
                    nll = -(new * trained).sum()
                    (nll / tokens).backward()
                    loss_sum += float(nll.detach())
                grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                results.append({"loss": loss_sum / tokens, "grad_norm": grad_norm, "learning_rate": lr,
                                "trained_tokens": float(tokens), "sequences": float(len(batch))})
                progress(done, len(batches))
        finally:
            state.optimizer.zero_grad(set_to_none=True)
            model.eval()
        return results

    def _logprobs(self, state: ModelState, batch: list[Sequence]):
        """A micro-batch's new logprobs and trained mask (shifted by one token), and its padded ids and mask."""
        pad = state.tokenizer.pad_token_id or 0
        ids = _padded([s.token_ids for s in batch], pad)
        attention = _padded([[1] * len(s.token_ids) for s in batch], 0)
        trained = _padded([s.trained for s in batch], False)[:, 1:]
        new = _token_logprobs(state.model(input_ids=ids, attention_mask=attention).logits, ids)
        return new, trained, ids, attention

    def _loss(self, state: ModelState, batch: list[Sequence], config: TrainConfig):
        dev = device()
        new, trained, ids, attention = self._logprobs(state, batch)
        old = _padded([s.old_logprobs for s in batch], float("nan"))[:, 1:]
        advantages = torch.tensor([[s.advantage] for s in batch], device=dev)
        ref = None
        if config.beta > 0 or config.kl_penalty_coef > 0:
            with torch.no_grad(), state.model.disable_adapter():
                ref = _token_logprobs(state.model(input_ids=ids, attention_mask=attention).logits, ids)
        return grpo_loss_sums(new, old, advantages, trained, epsilon=config.epsilon,
                              epsilon_high=config.epsilon_high or config.epsilon, ref_logprobs=ref,
                              loss_fn=config.loss_fn, kl_penalty_coef=config.kl_penalty_coef)


def _optimizer(state: ModelState) -> torch.optim.Optimizer:
    """The model's AdamW over its LoRA parameters, made on first use and kept (with its moments) across steps."""
    if state.optimizer is None:
        params = [p for p in state.model.parameters() if p.requires_grad]
        state.optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    return state.optimizer


def _padded(rows: list[list], fill) -> torch.Tensor:
    """Right-padded to the longest row, on the training device."""
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], device=device())


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) for t >= 1, shape (batch, length - 1)."""
    logits = logits[:, :-1].float()
    targets = ids[:, 1:]
    return -F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                            reduction="none").view(targets.shape)
