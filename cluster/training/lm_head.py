"""The LM head without the [tokens x vocabulary] float32 logits: the log-probability of each trained token and the
policy's entropy there, computed a slice of tokens at a time from the final hidden states.

A frozen head (LoRA never trains it) has a per-token gradient that the forward pass can finish on its own:
d log p(y | h) / dh = W[y] - softmax(hW) W, a [hidden] vector per token. So each slice's logits live only inside the
forward loop, which keeps that vector ([tokens x hidden], the size of the hidden states), and the backward pass only
scales it by the loss's gradient of each token's log-probability: the same two head matmuls as the plain path (no
recompute) and no [tokens x vocabulary] tensor kept for backward. Liger Kernel's fused linear cross-entropy does the
same for a scalar loss; with per-token losses (what GRPO needs) it recomputes the logits in backward, has no entropy,
and is Triton (CUDA) only, so this is plain torch, the same on every device (see docs/benchmarks.md, "Trainer").

`hidden_states(model)` gets those hidden states from any causal LM: its forward runs with the head swapped for a
pass-through, whatever the model does around it (FSDP2's root unshards the head's weight for the forward, and keeps
it until backward). A model whose logits are more than `head(hidden)` (softcapping, scaling, a head PEFT trains) is
found out once by `fused_head` and keeps the plain path: full logits, only at the trained positions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 1 << 25  # logits per slice (tokens x vocabulary): 128 MiB in float32, whatever the batch
_checked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # model -> does the fused head fit it


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_elements: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets[i] | hidden[i]) (with the gradient to `hidden`) and the entropy of the whole next-token
    distribution (a metric: no gradient), both float32 of shape [tokens]; `hidden` is [tokens, hidden size] and
    `weight` the head's [vocabulary, hidden size], which gets no gradient."""
    wants_grad = torch.is_grad_enabled() and hidden.requires_grad
    rows = max(1, (chunk_elements or CHUNK_ELEMENTS) // weight.shape[0])
    return _FusedHead.apply(hidden, weight.detach(), targets, rows, wants_grad)


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, rows, wants_grad):
        logprobs = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        entropies = torch.empty_like(logprobs)
        grad = torch.empty_like(hidden) if wants_grad else None  # d logprob / d hidden, per token
        for begin in range(0, hidden.shape[0], rows):
            end = min(begin + rows, hidden.shape[0])
            logits = (hidden[begin:end] @ weight.T).float()
            picked = targets[begin:end, None]
            log_z = torch.logsumexp(logits, dim=-1)
            logprobs[begin:end] = logits.gather(1, picked)[:, 0] - log_z
            probs = (logits - log_z[:, None]).exp_()
            entropies[begin:end] = log_z - (probs * logits).sum(-1)
            del logits
            if grad is not None:
                probs.scatter_add_(1, picked, torch.full_like(picked, -1.0, dtype=probs.dtype))  # softmax - onehot
                torch.mm(probs.to(weight.dtype), weight, out=grad[begin:end]).neg_()
        ctx.mark_non_differentiable(entropies)
        ctx.save_for_backward(grad if grad is not None else hidden.new_empty(0))
        return logprobs, entropies

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropies):
        (grad,) = ctx.saved_tensors
        return grad * grad_logprobs[:, None].to(grad.dtype), None, None, None, None


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain path (for a head the fused one does not fit): log p(targets) from logits already computed, and the
    entropy a slice at a time with no graph kept."""
    logprobs = -F.cross_entropy(logits.float(), targets, reduction="none")
    with torch.no_grad():
        entropies = torch.empty(logits.shape[0], device=logits.device)
        step = max(1, CHUNK_ELEMENTS // logits.shape[-1])
        for begin in range(0, logits.shape[0], step):
            logp = torch.log_softmax(logits[begin : begin + step].float(), dim=-1)
            entropies[begin : begin + step] = -(logp.exp() * logp).sum(-1)
    return logprobs, entropies


@contextmanager
def hidden_states(model: Any) -> Iterator[None]:
    """Within the block the model's forward returns the final hidden states as its `logits`: its head module is
    swapped for a pass-through (the trainer's own model, under the server's model lock)."""
    owner, name, head = _head(model)
    setattr(owner, name, torch.nn.Identity())
    try:
        yield
    finally:
        setattr(owner, name, head)


def head_weight(model: Any) -> torch.Tensor:
    return _head(model)[2].weight


def fused_head(model: Any, hidden: Callable, logits: Callable) -> bool:
    """Does the fused head compute this model's logits? The head must be a frozen `nn.Linear` without bias, and
    `head(hidden)` must be what the model's own forward returns (checked once per model on four tokens: a model that
    softcaps or scales its logits fails it). `hidden(model, ids)` and `logits(model, ids)` are the trainer's
    forwards to the hidden states and to the logits."""
    if model in _checked:
        return _checked[model]
    head = _head(model)[2]
    fits = type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad
    if fits:
        ids = torch.arange(3, 7, device=head.weight.device)[None] % head.weight.shape[0]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                expected = logits(model, ids).float()
                got = F.linear(hidden(model, ids), head_weight(model)).float()
        finally:
            model.train(was_training)
        fits = torch.allclose(got, expected, rtol=1e-3, atol=1e-3 * (1.0 + float(expected.abs().max())))
    _checked[model] = fits
    return fits


def _head(model: Any) -> tuple[Any, str, Any]:
    """The module that owns the output head, its attribute name, and the head."""
    head = model.get_output_embeddings()
    for owner in model.modules():
        for name, child in owner.named_children():
            if child is head:
                return owner, name, head
    raise RuntimeError(f"{type(model).__name__} has no output head among its modules")
