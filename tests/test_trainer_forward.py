"""The trainer's forward pass: packed micro-batches (no padding) and the fused, chunked LM head (no [tokens x
vocabulary] float32 logits) give the loss, the gradients and the metrics of the plain computation: padded rows, full
logits, float32 log-softmax (`reference_loss`, the trainer's code before them)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from art_sky.cluster.model_state import load_peft
from art_sky.cluster.training import lm_head, packing
from art_sky.cluster.training.grpo import grpo_loss_sums
from art_sky.cluster.training.peft_trainer import PeftTrainer, Policy, pad_id
from art_sky.cluster.training.sequences import Sequence
from art_sky.cluster.training.weights import make_optimizer, trainable
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest, TrainConfig

CONFIGS = {
    "ppo": TrainConfig(learning_rate=1e-3),
    "ppo-beta": TrainConfig(learning_rate=1e-3, beta=0.1),
    "cispo-kl-penalty": TrainConfig(learning_rate=1e-3, loss_fn="cispo", epsilon=1.0, kl_penalty_coef=0.5),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model with a fresh LoRA whose B is not zero (so the adapter changes the logits), and its pad id."""
    settings = Settings(cache_dir=tmp_path_factory.mktemp("cache"))
    model, tokenizer = load_peft(RegisterRequest(name="m", project="p", base_model="art-sky/tiny"), settings, None)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in trainable(model):
            param.normal_(0, 0.05)
    return model, pad_id(tokenizer)


def batch(seed: int, rows: int = 6) -> list[Sequence]:
    """Mixed lengths, prompts of any length, multi-turn masks (a trained turn, a tool result, another turn), old
    logprobs on some tokens (NaN on the others: the on-policy path)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        length = rng.randint(6, 60)
        prompt = rng.randint(1, length - 3)
        trained = [False] * prompt + [rng.random() > 0.2 for _ in range(length - prompt)]
        trained[-1] = True
        old = [rng.uniform(-7.0, -4.0) if t and rng.random() > 0.3 else math.nan for t in trained]
        out.append(Sequence([rng.randint(3, 250) for _ in range(length)], trained, old, rng.choice([-1.0, 0.5, 1.0])))
    return out


def reference_loss(model, batch: list[Sequence], pad: int, config: TrainConfig):
    """The computation before packing and the fused head: padded rows, logits from the first position that predicts
    a trained token on, float32 log-softmax, the entropy from those logits."""
    device = next(model.parameters()).device
    width = max(len(s.token_ids) for s in batch)
    ids = torch.tensor([s.token_ids + [pad] * (width - len(s.token_ids)) for s in batch], device=device)
    start = max(min(s.trained.index(True) for s in batch) - 1, 0)
    trained = torch.tensor([s.trained + [False] * (width - len(s.trained)) for s in batch], device=device)
    old = torch.tensor([s.old_logprobs + [math.nan] * (width - len(s.trained)) for s in batch], device=device)
    trained, old = trained[:, start + 1 :], old[:, start + 1 :]

    def logprobs(logits):
        flat = logits[:, :-1].float()
        return -F.cross_entropy(
            flat.reshape(-1, flat.shape[-1]), ids[:, start + 1 :].reshape(-1), reduction="none"
        ).view(len(batch), -1)

    logits = model(input_ids=ids, logits_to_keep=width - start).logits
    new = logprobs(logits)
    with torch.no_grad():
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        entropies = -(logp.exp() * logp).sum(-1)
    ref = None
    if config.beta > 0 or config.kl_penalty_coef > 0:
        with torch.no_grad(), model.disable_adapter():
            ref = logprobs(model(input_ids=ids, logits_to_keep=width - start).logits)
    advantages = torch.tensor([[s.advantage] for s in batch], device=device)
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
    )
    return parts, (entropies * trained).sum()


def loss_and_grads(loss_fn, model, config: TrainConfig):
    model.train()
    try:
        parts, entropy = loss_fn()
        (parts.policy + config.beta * parts.kl).backward()
        grads = [p.grad.clone() for p in trainable(model)]
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    return [float(parts.policy), float(parts.kl), float(parts.clipped), float(entropy)], grads


class Padded(PeftTrainer):
    """The trainer on padded rows (what the Unsloth trainer and a model without the packed attention use)."""

    def packs(self, model) -> bool:
        return False


@pytest.mark.parametrize("trainer", [PeftTrainer(4096), Padded(4096)], ids=["packed", "padded-rows"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_packed_micro_batches_and_the_fused_head_give_the_plain_loss_gradients_and_entropy(tiny, trainer, config):
    model, pad = tiny
    sequences = batch(0)
    policy = Policy(model, make_optimizer(model), pad)
    expected, expected_grads = loss_and_grads(lambda: reference_loss(model, sequences, pad, config), model, config)
    got, grads = loss_and_grads(lambda: trainer._loss(policy, sequences, config), model, config)
    assert packing.packs(model) and trainer.fuses_head(model)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
    for got_grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert torch.allclose(got_grad, expected_grad, rtol=1e-3, atol=1e-4)


def test_a_packed_step_over_several_micro_batches_trains_as_one_plain_pass(tiny):
    """The whole step: packed micro-batches of at most 64 tokens accumulate to the metrics and the AdamW update of
    the plain computation over the whole batch at once."""
    model, pad = tiny
    config, sequences = CONFIGS["ppo-beta"], batch(1, rows=8)
    twin = copy.deepcopy(model)
    trainer = PeftTrainer(64)
    assert len(trainer.microbatches(sequences, packed=True)) > 2
    metrics = trainer.grpo_step(
        Policy(model, make_optimizer(model), pad),
        trainer.microbatches(sequences, True),
        sum(s.trained_tokens for s in sequences),
        len(sequences),
        config,
    )

    optimizer, total = make_optimizer(twin), sum(s.trained_tokens for s in sequences)
    for group in optimizer.param_groups:
        group["lr"] = config.learning_rate
    twin.train()
    parts, entropy = reference_loss(twin, sequences, pad, config)
    ((parts.policy + config.beta * parts.kl) / total).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable(twin), config.max_grad_norm)
    optimizer.step()
    assert metrics["policy_loss"] == pytest.approx(float(parts.policy) / total, rel=1e-4, abs=1e-6)
    assert metrics["kl"] == pytest.approx(float(parts.kl) / total, rel=1e-4, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(float(entropy) / total, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(float(parts.clipped) / total)
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
    for param, expected in zip(trainable(model), trainable(twin), strict=True):
        assert torch.allclose(param, expected, rtol=1e-4, atol=1e-6)


def test_packed_micro_batches_hold_the_budget_in_tokens_without_padding():
    sequences = [Sequence([5] * n, [True] * n, [math.nan] * n) for n in (10, 30, 30, 50, 100, 300)]
    packed = PeftTrainer(128).microbatches(sequences, packed=True)
    assert [[len(s.token_ids) for s in b] for b in packed] == [[10, 30, 30, 50], [100], [300]]  # 300: on its own
    padded = PeftTrainer(128).microbatches(sequences, packed=False)
    assert [[len(s.token_ids) for s in b] for b in padded] == [[10, 30, 30], [50], [100], [300]]


class LargestVocabularyTensor(TorchDispatchMode):
    """The most rows of any float tensor an op makes (not a view) whose last dimension is the vocabulary."""

    def __init__(self, vocabulary: int):
        super().__init__()
        self.vocabulary, self.rows = vocabulary, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.is_floating_point()
                and tensor.dim()
                and tensor.shape[-1] == self.vocabulary
            ):
                self.rows = max(self.rows, tensor.numel() // self.vocabulary)
        return out


def test_the_chunked_head_never_makes_a_tokens_by_vocabulary_tensor(tiny, monkeypatch):
    """Forward and backward: logits exist only a slice of 8 tokens at a time (the plain path makes them for every
    token at once)."""
    model, pad = tiny
    vocabulary = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 8 * vocabulary)
    sequences, config = batch(2), CONFIGS["ppo"]
    policy = Policy(model, make_optimizer(model), pad)
    PeftTrainer(4096)._loss(policy, sequences, config)  # the head's one-time check runs outside the count
    for run, most in [
        (lambda: PeftTrainer(4096)._loss(policy, sequences, config), 8),
        (lambda: reference_loss(model, sequences, pad, config), 100),
    ]:
        with LargestVocabularyTensor(vocabulary) as largest:
            loss_and_grads(run, model, config)
        assert (largest.rows <= most) if most == 8 else (largest.rows >= most), largest.rows


@pytest.mark.parametrize("rows", [1, 5, 300], ids=["one-token-chunks", "chunked", "one-chunk"])
def test_the_fused_head_matches_log_softmax_with_any_upstream_gradient(rows):
    """log p, entropy and d(sum of g * log p)/d hidden against float64 log-softmax on full logits, with per-token
    upstream weights g (what the GRPO loss gives each token), over chunks of any size."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37, dtype=torch.float64)
    logprobs, entropies = lm_head.token_logprobs(hidden, weight, targets, chunk_elements=rows * 50)
    (logprobs.double() * upstream).sum().backward()
    fused_grad, hidden.grad = hidden.grad, None
    logp = torch.log_softmax(hidden @ weight.T, -1)
    expected = logp.gather(1, targets[:, None])[:, 0]
    (expected * upstream).sum().backward()
    assert torch.allclose(logprobs.double(), expected, atol=1e-5)
    assert torch.allclose(entropies.double(), -(logp.exp() * logp).sum(-1), atol=1e-5)
    assert torch.allclose(fused_grad, hidden.grad, atol=1e-5)
    assert not entropies.requires_grad


def test_a_head_the_fused_path_cannot_compute_keeps_the_models_own_logits(tiny):
    """A head with a bias (as any logit transform) fails the fused head's check: the model's own logits score the
    trained tokens, and the loss is still the plain one."""
    model, pad = tiny
    twin = copy.deepcopy(model)
    head = twin.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.linspace(-1, 1, head.weight.shape[0]), requires_grad=False)
    trainer, config = PeftTrainer(4096), CONFIGS["ppo"]
    assert not trainer.fuses_head(twin)
    sequences = batch(3)
    policy = Policy(twin, make_optimizer(twin), pad)
    expected, _ = loss_and_grads(lambda: reference_loss(twin, sequences, pad, config), twin, config)
    got, _ = loss_and_grads(lambda: trainer._loss(policy, sequences, config), twin, config)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_attends_within_each_sequence(window):
    """One packed row of three sequences: each position attends to its own sequence's earlier tokens (within the
    sliding window when there is one), as the 4D block-diagonal mask transformers would build."""
    torch.manual_seed(0)
    lengths = [4, 7, 2]
    total = sum(lengths)
    query, key, value = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    bounds = torch.tensor([0, 4, 11, 13], dtype=torch.int32)
    out, _ = packing.packed_attention(
        None,
        query,
        key,
        value,
        None,
        scaling=0.3,
        sliding_window=window,
        cu_seq_lens_q=bounds,
        cu_seq_lens_k=bounds,
        max_length_q=7,
        max_length_k=7,
    )
    sequence = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    at = torch.arange(total)
    allowed = (sequence[:, None] == sequence[None, :]) & (at[:, None] >= at[None, :])
    if window:
        allowed &= at[:, None] - at[None, :] < window
    expected = F.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=allowed, scale=0.3
    )
    assert out.shape == (1, total, 4, 8)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)


def test_activation_checkpointing_recomputes_each_layer_and_changes_no_gradient(tiny):
    """ART_SKY_ACTIVATION_CHECKPOINTING=on: every decoder layer runs again in the backward pass (packed rows, kwargs
    and all), and the loss and gradients are those of keeping the activations."""
    from art_sky.cluster.training.activations import set_checkpointing

    model, pad = tiny
    sequences, config = batch(4), CONFIGS["ppo-beta"]
    policy = Policy(model, make_optimizer(model), pad)
    trainer = PeftTrainer(4096)
    # the trainer's one-time checks of the model (packed rows, fused head) run here, not inside the count below
    assert trainer.packs(model) and trainer.fuses_head(model)
    mlp = model.get_base_model().model.layers[0].mlp  # inside the layer: run again when the layer is recomputed
    calls, forward = [], mlp.forward

    def counted(*args, **kwargs):  # module hooks do not run in a checkpoint's recompute; the forward does
        calls.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    mlp.forward = counted
    try:
        expected, expected_grads = loss_and_grads(
            lambda: PeftTrainer(4096, "off")._loss(policy, sequences, config), model, config
        )
        without = len(calls)
        got, grads = loss_and_grads(lambda: PeftTrainer(4096, "on")._loss(policy, sequences, config), model, config)
    finally:
        del mlp.forward
        set_checkpointing(model, False)
    assert without == 2 and len(calls) - without == 3  # with: the forward, the reference's, the recompute
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for got_grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert torch.allclose(got_grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_a_model_whose_attention_ignores_packed_rows_trains_on_padded_rows(tiny, monkeypatch):
    """Its forward does not hand the packed boundaries to attention (here: attention over the whole row): the
    trainer's one-time check finds two packed sequences scoring otherwise than alone, and the model trains on padded
    rows, with the plain loss."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def unaware(module, query, key, value, attention_mask, **kwargs):
        kept = {k: v for k, v in kwargs.items() if not k.startswith(("cu_seq_lens", "max_length"))}
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kept)

    model, pad = tiny
    trainer, config, sequences = PeftTrainer(4096), CONFIGS["ppo"], batch(5)
    assert trainer.packs(model)
    twin = copy.deepcopy(model)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, packing.PACKED, unaware)
    assert not trainer.packs(twin) and trainer.packs(model)  # the model checked before keeps its answer
    policy = Policy(twin, make_optimizer(twin), pad)
    expected, _ = loss_and_grads(lambda: reference_loss(twin, sequences, pad, config), twin, config)
    got, _ = loss_and_grads(lambda: trainer._loss(policy, sequences, config), twin, config)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)
