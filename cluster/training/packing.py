"""Micro-batches as the model reads them: packed (every sequence end to end in one row, no padding) where the model's
attention is ours, else right-padded rows; and where each trained token's scores go back to per-row tensors.

Packing is transformers' own format (what `DataCollatorWithFlattening` gives flash-attention models): position ids
that restart at 0 for each sequence and the sequences' boundaries as `cu_seq_lens_q/k` and `max_length_q/k`, which
the model hands to its attention function. `PACKED`, registered with transformers' AttentionInterface, is SDPA
(transformers' own function) for any other call, and for a packed row attends within each sequence only: torch's
variable-length flash attention (`torch.nn.attention.varlen`) on CUDA in half precision, SDPA one sequence at a
time elsewhere (the CPU reference, and float32). A pad token costs nothing, and neither does attention across
sequences: mixed-length GRPO groups do no wasted work.

Only the positions that predict a trained token go through the LM head (cluster/training/lm_head.py): a prompt costs
no head at all. The loss (cluster/training/grpo.py) still sees one row per sequence, [rows, longest - 1], with the
trained mask, old logprobs and advantages exactly as before: a score of a position that is not trained is 0 and
always masked.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .sequences import Sequence

log = logging.getLogger("art_sky.cluster")
_checked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # model -> reads packed rows

PACKED = "art_sky_packed"


@dataclass
class Layout:
    """One micro-batch: the forward's keyword arguments, the flat positions of its output that predict a trained
    token, the tokens they predict, and where each score goes in the [rows, width - 1] per-row tensors."""

    inputs: dict[str, Any]
    select: torch.Tensor
    targets: torch.Tensor
    place: torch.Tensor
    rows: int
    width: int

    def per_row(self, scores: torch.Tensor) -> torch.Tensor:
        """[rows, width - 1]: each trained token's score (keeps the gradient), 0 elsewhere."""
        flat = scores.new_zeros(self.rows * (self.width - 1))
        return flat.index_copy(0, self.place, scores).view(self.rows, self.width - 1)


def layout(batch: list[Sequence], pad_id: int, packed: bool, device: torch.device) -> Layout:
    width = max(len(s.token_ids) for s in batch)
    select, place, targets = [], [], []
    offset = 0
    for row, seq in enumerate(batch):
        start = offset if packed else row * width
        for t in range(len(seq.token_ids) - 1):
            if seq.trained[t + 1]:
                select.append(start + t)
                place.append(row * (width - 1) + t)
                targets.append(seq.token_ids[t + 1])
        offset += len(seq.token_ids)
    return Layout(
        _inputs(batch, pad_id, packed, width, device),
        torch.tensor(select, device=device, dtype=torch.long),
        torch.tensor(targets, device=device, dtype=torch.long),
        torch.tensor(place, device=device, dtype=torch.long),
        len(batch),
        width,
    )


def _inputs(batch: list[Sequence], pad_id: int, packed: bool, width: int, device: torch.device) -> dict[str, Any]:
    if not packed:  # right-padded and causal: no real token sees a pad, so no mask (SDPA's fast causal path)
        ids = [s.token_ids + [pad_id] * (width - len(s.token_ids)) for s in batch]
        return {"input_ids": torch.tensor(ids, device=device), "use_cache": False}
    lengths = [len(s.token_ids) for s in batch]
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], device=device, dtype=torch.int32)
    return {
        "input_ids": torch.tensor([[t for s in batch for t in s.token_ids]], device=device),
        "position_ids": torch.tensor([[p for n in lengths for p in range(n)]], device=device),
        "attention_mask": torch.ones(1, sum(lengths), device=device, dtype=torch.long),  # no packed 4D mask built
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "use_cache": False,
    }


def packs(model: Any, logits: Callable | None = None) -> bool:
    """Does this model read packed micro-batches: its attention is `PACKED` and, with `logits(model, inputs)` (the
    trainer's forward), once per model, two sequences packed in one row score as each alone? A model whose forward
    does not hand transformers' packed arguments to its attention fails that, and trains on padded rows."""
    if getattr(model.config, "_attn_implementation", None) != PACKED:
        return False
    if logits is None:
        return True
    if model not in _checked:
        _checked[model] = _reads_packed_rows(model, logits)
    return _checked[model]


def _reads_packed_rows(model: Any, logits: Callable) -> bool:
    device = model.get_input_embeddings().weight.device
    first, second = Sequence([3, 4, 5, 6, 7], [True] * 5), Sequence([8, 9, 10], [True] * 3)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [
                logits(model, _inputs([seq], 0, False, len(seq.token_ids), device))[0].float()
                for seq in (first, second)
            ]
            packed = logits(model, _inputs([first, second], 0, True, 5, device))[0].float()
    except TypeError as exc:  # its forward takes no packed arguments
        log.warning("%s trains on padded rows: its forward does not take packed rows (%s)", type(model).__name__, exc)
        return False
    finally:
        model.train(was_training)
    expected = torch.cat(alone)
    same = bool(((packed - expected).abs().max() <= 0.02 * expected.abs().max() + 1e-3).item())
    if not same:
        log.warning(
            "%s trains on padded rows: two sequences packed in one row do not score as each alone", type(model).__name__
        )
    return same


def use_packed_attention(model: Any) -> None:
    """Give a model that attends with SDPA (transformers' default) the packed attention; others keep theirs, as
    does every model under a transformers without attention interfaces, and train on padded rows."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    try:
        _register()
        model.set_attn_implementation(PACKED)
    except (ImportError, AttributeError, ValueError) as exc:
        log.info(
            "%s trains on padded rows: this transformers cannot give it packed attention (%s)",
            type(model).__name__,
            exc,
        )


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, heads, tokens, dim], key and value [1, kv heads, tokens,
    dim]; returns [1, tokens, heads, dim]."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    varlen_attn = _varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    if varlen_attn is not None and dropout == 0.0:
        longest, window = kwargs["max_length_q"], (sliding_window - 1 if sliding_window else -1, 0)
        out = varlen_attn(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            bounds,
            bounds,
            longest,
            longest,
            scale=scaling,
            window_size=window,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out[None], None
    parts = []
    for begin, end in itertools.pairwise(bounds.tolist()):
        q, k, v = (t[:, :, begin:end] for t in (query, key, value))
        band = _window(end - begin, sliding_window, query.device)
        parts.append(
            F.scaled_dot_product_attention(
                q, k, v, attn_mask=band, dropout_p=dropout, is_causal=band is None, scale=scaling, enable_gqa=True
            )
        )
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


@functools.cache
def _varlen() -> Callable | None:
    """torch's variable-length flash attention (torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _window(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A sliding window's mask (each token sees itself and the window - 1 before it), or None: plain causal."""
    if not window or length <= window:
        return None
    at = torch.arange(length, device=device)
    distance = at[:, None] - at[None, :]
    return (distance >= 0) & (distance < window)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED, packed_attention)
    AttentionMaskInterface.register(PACKED, sdpa_mask)
