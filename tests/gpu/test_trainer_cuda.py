"""The trainer's fast path on CUDA, in bf16 (what tests/test_trainer_forward.py checks on a CPU in float32): packed
micro-batches (torch's variable-length flash attention) and the fused LM head give the loss, gradients and entropy
of the plain computation (padded rows, SDPA, full float32 logits) within bf16's precision, and take less memory.

Needs CUDA (tests/gpu/run_trainer_bench.sh runs it on a lent GPU); elsewhere it skips.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from random_models import build, sequences
from test_trainer_forward import CONFIGS, Padded, loss_and_grads, reference_loss

from art_sky.cluster.model_state import load_peft
from art_sky.cluster.training import packing
from art_sky.cluster.training.peft_trainer import PeftTrainer, Policy
from art_sky.cluster.training.weights import make_optimizer, trainable
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

SHAPE = os.environ.get("ART_SKY_GPU_SHAPE", "qwen2-0.5b")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cache = Path(os.environ.get("ART_SKY_CACHE_DIR", tmp_path_factory.mktemp("cache")))
    request = RegisterRequest(name="m", project="p", base_model=str(build(SHAPE, cache)))
    peft_model, _ = load_peft(request, Settings(cache_dir=cache), None)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in trainable(peft_model):
            param.normal_(0, 0.02)
    return peft_model


@pytest.mark.parametrize("trainer", [PeftTrainer(8192), Padded(8192)], ids=["packed", "padded-rows"])
def test_packed_and_fused_on_cuda_match_the_plain_loss_in_bf16(model, trainer):
    assert packing.packs(model), "the model attends with the packed attention"
    batch = sequences(8, 512, 128, model.config.vocab_size, mixed=True)
    config = CONFIGS["ppo-beta"]
    policy = Policy(model, make_optimizer(model), 0)
    torch.cuda.reset_peak_memory_stats()
    expected, expected_grads = loss_and_grads(lambda: reference_loss(model, batch, 0, config), model, config)
    plain_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got, grads = loss_and_grads(lambda: trainer._loss(policy, batch, config), model, config)
    peak = torch.cuda.max_memory_allocated()
    assert trainer.fuses_head(model)
    print(
        f"\n{SHAPE} {type(trainer).__name__}: loss {got[0]:.4f} vs {expected[0]:.4f}, entropy {got[3]:.2f} vs "
        f"{expected[3]:.2f}; peak {peak / 2**30:.2f} GiB vs {plain_peak / 2**30:.2f} GiB"
    )
    assert got == pytest.approx(expected, rel=2e-2, abs=2e-2)
    cosine = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten().float() for g in grads]), torch.cat([g.flatten().float() for g in expected_grads]), dim=0
    )
    assert cosine > 0.99, float(cosine)
    assert peak < plain_peak


def test_a_step_on_cuda_trains_as_the_plain_step_in_bf16(model):
    """The whole step (packed micro-batches, the LoRA in bf16 under autocast without PEFT's fp32 copies of its
    inputs, AdamW) against the plain computation over the whole batch at once."""
    twin = copy.deepcopy(model)
    batch, config = sequences(8, 512, 128, model.config.vocab_size, mixed=True), CONFIGS["ppo"]
    total = sum(s.trained_tokens for s in batch)
    trainer = PeftTrainer(2048)
    assert len(trainer.microbatches(batch, packed=True)) > 1
    metrics = trainer.grpo_step(
        Policy(model, make_optimizer(model), 0), trainer.microbatches(batch, True), total, len(batch), config
    )
    twin.train()
    parts, entropy = reference_loss(twin, batch, 0, config)
    (parts.policy / total).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable(twin), config.max_grad_norm)
    print(
        f"\n{SHAPE} step: policy loss {metrics['policy_loss']:.5f} vs {float(parts.policy) / total:.5f}, grad norm "
        f"{metrics['grad_norm']:.4f} vs {float(grad_norm):.4f}"
    )
    assert metrics["policy_loss"] == pytest.approx(float(parts.policy) / total, rel=2e-2, abs=1e-3)
    assert metrics["entropy"] == pytest.approx(float(entropy) / total, rel=2e-2)
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=5e-2)
