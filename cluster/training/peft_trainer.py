"""The portable GRPO trainer: PEFT LoRA on any device, gradient accumulation over micro-batches.

One `train()` call is one optimizer step over every trained token of the batch (mean over trained tokens), however
many micro-batches it takes to fit in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from art_sky.settings import Settings
from art_sky.wire import RegisterRequest, TrainConfig

from ..model_state import LocalWeights, ModelState, TrainedWeights, device, ensure_optimizer, load_peft
from .grpo import grpo_loss_sums
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

    def __init__(self, microbatch_tokens: int):
        self.microbatch_tokens = microbatch_tokens

    def close(self) -> None:
        """Nothing runs beside the server."""

    def load_model(self, request: RegisterRequest, settings: Settings, checkpoint: Path | None) -> tuple[Any, Any]:
        """The model this trainer trains, (peft model, tokenizer): transformers plus a PEFT LoRA."""
        return load_peft(request, settings, checkpoint)

    def load_weights(self, state: ModelState, step_dir: Path | None) -> TrainedWeights:
        """The model's LoRA and AdamW, trained in this process."""
        return LocalWeights.load(state, step_dir)

    def train(self, state: ModelState, sequences: list[Sequence], config: TrainConfig,
              progress: Progress = lambda done, total: None) -> dict[str, float]:
        """Blocking: run it off the event loop, under the server's model lock."""
        policy = Policy(state.model, ensure_optimizer(state), pad_id(state.tokenizer))
        return self.grpo_step(policy, self.microbatches(sequences), sum(s.trained_tokens for s in sequences),
                              len(sequences), config, progress)

    def grpo_step(self, policy: Policy, batches: list[list[Sequence]], total_tokens: int, rows: int,
                  config: TrainConfig, progress: Progress = lambda done, total: None) -> dict[str, float]:
        """One optimizer step over `batches` (this process's micro-batches; a rank's share on ranks), the loss
        divided by the step's `total_tokens` on every process, so the summed gradients are the whole step's."""
        model, optimizer = policy.model, policy.optimizer
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate
        measured_kl = config.beta > 0 or config.kl_penalty_coef > 0  # a reference pass runs only then
        sums = torch.zeros(4, device=device())  # policy, kl, clipped, entropy: summed on the device, read once
        model.train()
        try:
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

    def microbatches(self, sequences: list[Sequence]) -> list[list[Sequence]]:
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
        policy = Policy(state.model, ensure_optimizer(state), pad_id(state.tokenizer))
        shares = [(self.microbatches(batch), sum(s.trained_tokens for s in batch), len(batch)) for batch in batches]
        return self.sft_steps(policy, shares, learning_rates, max_grad_norm, progress)

    def sft_steps(self, policy: Policy, shares: list[tuple[list[list[Sequence]], int, int]],
                  learning_rates: list[float], max_grad_norm: float,
                  progress: Progress = lambda done, total: None) -> list[dict[str, float]]:
        """One optimizer step per batch: (its micro-batches here, its trained tokens, its rows) and a rate each."""
        model, optimizer = policy.model, policy.optimizer
        results = []
        model.train()
        try:
            for done, ((micro, tokens, rows), lr) in enumerate(zip(shares, learning_rates), start=1):
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device())
                for index, batch in enumerate(micro, start=1):
                    policy.last(index == len(micro))
                    new, trained, _, _, _ = self._logprobs(policy, batch)
                    nll = -(new * trained).sum()
                    (nll / tokens).backward()
                    loss_sum += nll.detach()
                grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(trainable(model), max_grad_norm)))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                results.append({"loss": float(policy.reduce(loss_sum)) / tokens, "grad_norm": grad_norm,
                                "learning_rate": lr, "trained_tokens": float(tokens), "sequences": float(rows)})
                progress(done, len(shares))
        finally:
            optimizer.zero_grad(set_to_none=True)
            model.eval()
        return results

    def _logprobs(self, policy: Policy, batch: list[Sequence], entropy: bool = False):
        """A micro-batch's new logprobs and trained mask from its first trained position on (shifted by one
        token), its padded ids, that position, and (with `entropy`) the policy's entropy at each position.

        Rows are right-padded and attention is causal, so no real token sees a pad and no attention mask is needed
        (SDPA keeps its fast causal path); logits are computed only from the first position that predicts a
        trained token (a shared prompt costs no LM head and no float32 logits)."""
        ids = _padded([s.token_ids for s in batch], policy.pad_id)
        start = max(min(next((i for i, t in enumerate(s.trained) if t), len(s.trained)) for s in batch) - 1, 0)
        trained = _padded([s.trained for s in batch], False)[:, start + 1:]
        logits = self._logits(policy.model, ids, start)
        new = _token_logprobs(logits, ids[:, start:])
        return new, trained, ids, start, (_entropies(logits) if entropy else None)

    @staticmethod
    def _logits(model: Any, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The model's logits at positions start.. of `ids`."""
        return model(input_ids=ids, logits_to_keep=ids.shape[1] - start).logits

    def _loss(self, policy: Policy, batch: list[Sequence], config: TrainConfig):
        """The micro-batch's loss sums and the summed entropy of the policy over its trained tokens."""
        dev = device()
        new, trained, ids, start, entropies = self._logprobs(policy, batch, entropy=True)
        old = _padded([s.old_logprobs for s in batch], float("nan"))[:, start + 1:]
        advantages = torch.tensor([[s.advantage] for s in batch], device=dev)
        ref = None
        if config.beta > 0 or config.kl_penalty_coef > 0:
            with torch.no_grad(), policy.model.disable_adapter():
                ref = _token_logprobs(self._logits(policy.model, ids, start), ids[:, start:])
        parts = grpo_loss_sums(new, old, advantages, trained, epsilon=config.epsilon,
                               epsilon_high=config.epsilon_high or config.epsilon, ref_logprobs=ref,
                               loss_fn=config.loss_fn, kl_penalty_coef=config.kl_penalty_coef,
                               kl_penalty_source=config.kl_penalty_source,
                               importance_sampling_level=config.importance_sampling_level,
                               old_policy=config.old_logprobs,
                               truncated_importance_sampling=config.truncated_importance_sampling)
        return parts, (entropies * trained).sum()


def pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id or 0


def _full(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm: on ranks `clip_grad_norm_` returns it as a sharded tensor of the whole norm."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _padded(rows: list[list], fill) -> torch.Tensor:
    """Right-padded to the longest row, on the training device."""
    width = max(len(row) for row in rows)
    return torch.tensor([row + [fill] * (width - len(row)) for row in rows], device=device())


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) for t >= 1, shape (batch, length - 1); `logits` are those of `ids`' positions."""
    logits = logits[:, :-1].float()
    targets = ids[:, 1:]
    return -F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                            reduction="none").view(targets.shape)


_ENTROPY_CHUNK = 1 << 24  # logits elements per slice: the entropy's temporaries stay small beside the logits


@torch.no_grad()
def _entropies(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of the next-token distribution at each position but the last, shape (batch, length - 1): from the
    logits the loss already computed, a slice of positions at a time, with no graph kept."""
    logits = logits[:, :-1]
    out = torch.empty(logits.shape[:2], device=logits.device)
    step = max(1, _ENTROPY_CHUNK // max(1, logits.shape[0] * logits.shape[2]))
    for begin in range(0, logits.shape[1], step):
        logp = torch.log_softmax(logits[:, begin:begin + step].float(), dim=-1)
        out[:, begin:begin + step] = -(logp.exp() * logp).sum(-1)
    return out
