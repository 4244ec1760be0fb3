"""The vLLM engine: vLLM's own OpenAI server as a child process, serving each model's newest LoRA under its name.

Inference reaches it through the server's own /v1 (one port for everything); the health route reports vLLM's port
for diagnostics. vLLM starts at the first registration, when the base model is known, and serves that
one base model. After every training step the new checkpoint is loaded under the model's name; `name@step`
resolves any checkpoint on disk on first use (vLLM's filesystem LoRA resolver over a folder of links).
While a model trains, vLLM is paused (requests queue, ART's semantics) and on CUDA put to sleep, so the trainer
gets its GPU memory back; it wakes and resumes after the step.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai.types.chat import ChatCompletion

from art_sky.errors import ConfigError, EngineError, EngineRequestError
from art_sky.files import tail
from art_sky.layout import step_name
from art_sky.settings import Settings
from art_sky.wire import ChatCompletionRequest, RegisterRequest

from .engine import Job
from .model_state import ModelState, device, resolve_base_model

log = logging.getLogger("art_sky.cluster")

# vLLM accepts only these LoRA rank limits (vllm.config.lora.MaxLoRARanks).
_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmEngine:
    name = "vllm"

    def __init__(self, settings: Settings, art_path: Path, api_key: str):
        self.settings, self.api_key = settings, api_key
        self.log_path = Path(art_path) / "logs" / "vllm.log"
        self.links = Path(art_path) / "vllm-adapters"  # <name>@<step> -> checkpoint dir, for the resolver
        self.sleep_mode = device().type == "cuda"  # vLLM's sleep mode needs CUDA's memory allocator
        self.inference_port: int | None = None
        self.base_model: str | None = None
        self.max_lora_rank = 0
        self._process: subprocess.Popen | None = None
        self._http: httpx.Client | None = None

    # -- the server's hooks ------------------------------------------------------------------------------------

    def check(self, request: RegisterRequest) -> None:
        """Before a model is loaded: can the running vLLM serve it? (One base model, its LoRA rank limit.)"""
        if self._process is None:
            return
        if request.base_model != self.base_model:
            raise ConfigError(f"this server's vLLM serves {self.base_model!r}; model {request.name!r} is on "
                              f"{request.base_model!r}: use one base model per cluster server")
        if request.config.lora_rank > self.max_lora_rank:
            raise ConfigError(f"model {request.name!r} has LoRA rank {request.config.lora_rank} but this server's "
                              f"vLLM was started with --max-lora-rank {self.max_lora_rank}: register it on a "
                              "fresh server")

    def attach(self, state: ModelState) -> None:
        """Serve a newly registered model: start vLLM on its base model if needed, load its current step."""
        if self._process is None:
            self._start(state)
        self._publish(state)

    def pause(self) -> None:
        """Before a training step: hold new requests, let running ones finish, free GPU memory on CUDA."""
        if self.sleep_mode:
            self._post("/sleep", params={"level": 1, "mode": "wait"})
        else:
            self._post("/pause", params={"mode": "wait"})

    def resume(self, state: ModelState, trained: bool) -> None:
        """After a training step: wake up, serve the new checkpoint under the model's name, release requests."""
        try:
            if self.sleep_mode:
                self._post("/wake_up")
            if trained:
                self._publish(state)
        finally:
            self._post("/resume")

    # The server's own /v1 route forwards to vLLM: all inference goes through it.
    def prepare(self, state: ModelState, request: ChatCompletionRequest) -> Job:
        return Job(state, request, prompt=[], budget=0)  # vLLM renders the prompt and checks the budget itself

    def run(self, jobs: list[Job]) -> list[ChatCompletion | EngineRequestError]:
        """Blocking: forward a batch concurrently; a request vLLM refuses gets vLLM's status and message."""
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(self._forward, jobs))

    def _forward(self, job: Job) -> ChatCompletion | EngineRequestError:
        response = self._client().post("/v1/chat/completions", json=job.request.model_dump(exclude_unset=True))
        if response.status_code >= 400:
            return EngineRequestError(response.status_code, f"vLLM: {_detail(response)}")
        return ChatCompletion.model_validate(response.json())

    def close(self) -> None:
        """Stop vLLM and its engine processes (its own process group)."""
        process, self._process = self._process, None
        if self._http is not None:
            self._http.close()
            self._http = None
        if process is None or process.poll() is not None:
            return
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(10)  # within the 15 s LocalBackend gives the server to stop
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait()
        log.info("vLLM stopped")

    # -- adapters ----------------------------------------------------------------------------------------------

    def _publish(self, state: ModelState) -> None:
        """Link every checkpoint for `name@step`, drop links (and adapters) of deleted steps, swap `name`."""
        self.links.mkdir(parents=True, exist_ok=True)
        for link in self.links.glob(f"{state.name}@*"):
            if not link.exists():  # its checkpoint was deleted: nothing refers to that adapter any more
                link.unlink()
                self._unload(link.name)
        for step in state.checkpoints.steps():
            link = self.links / f"{state.name}@{step}"
            if not link.is_symlink():
                link.symlink_to(state.checkpoints.step_dir(step).resolve(), target_is_directory=True)
        # An unload and a load, not vLLM's load_inplace: the request an in-place load stores keeps that flag, and
        # vLLM's worker re-reads such an adapter from disk whenever it activates it.
        path = state.checkpoints.step_dir(state.step).resolve()
        self._unload(state.name)
        self._post("/v1/load_lora_adapter", json={"lora_name": state.name, "lora_path": str(path)})
        log.info("vLLM serves %s at step %d (%s)", state.name, state.step, step_name(state.step))

    def _unload(self, lora_name: str) -> None:
        response = self._client().post("/v1/unload_lora_adapter", json={"lora_name": lora_name})
        if response.status_code not in (200, 404):  # 404: it was never loaded
            raise EngineError(f"vLLM refused to unload adapter {lora_name!r}: {_detail(response)}")

    # -- the child process -------------------------------------------------------------------------------------

    def _start(self, state: ModelState) -> None:
        config = state.request.config
        rank = next((r for r in _MAX_LORA_RANKS if r >= config.lora_rank), None)
        if rank is None:
            raise ConfigError(f"LoRA rank {config.lora_rank} is above vLLM's limit {_MAX_LORA_RANKS[-1]}")
        source = resolve_base_model(state.request.base_model, self.settings)
        port = _free_port()
        on_cuda = device().type == "cuda"
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", source, "--served-model-name", state.request.base_model,
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(self.settings.vllm_max_loras),
            "--max-model-len", str(config.max_seq_length),
            "--gpu-memory-utilization", str(self.settings.engine_gpu_memory),
            # float32 on CPU: the logprobs it reports then equal the trainer's own (the PPO ratio starts at 1)
            "--dtype", "auto" if on_cuda else "float32",
            "--disable-uvicorn-access-log",
        ]
        if self.settings.vllm_tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.settings.vllm_tool_call_parser]
        if self.sleep_mode:
            args.append("--enable-sleep-mode")
        else:
            log.info("vLLM sleep mode needs CUDA: on %s vLLM keeps its memory while training (paused only)",
                     device().type)
        self.links.mkdir(parents=True, exist_ok=True)
        env = os.environ | {
            "VLLM_API_KEY": self.api_key,  # not on argv, where `ps` shows it
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /sleep, /wake_up
            "VLLM_LORA_RESOLVER_CACHE_DIR": str(self.links),
        }
        if not on_cuda:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is far larger
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM on %s (port %d, log %s)", state.request.base_model, port, self.log_path)
        with open(self.log_path, "ab") as out:
            self._process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        self.inference_port, self.base_model, self.max_lora_rank = port, state.request.base_model, rank
        self._wait_ready()

    def _wait_ready(self) -> None:
        started = time.monotonic()
        deadline = started + self.settings.vllm_start_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self.close()
                raise EngineError(f"vLLM exited with code {code} while starting. Last lines of "
                                  f"{self.log_path}:\n{tail(self.log_path, 30)}")
            try:
                if self._client().get("/health", timeout=5).status_code == 200:
                    log.info("vLLM ready in %.0fs", time.monotonic() - started)
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.close()
        raise EngineError(f"vLLM was not ready within {self.settings.vllm_start_timeout:.0f}s "
                          f"(ART_SKY_VLLM_START_TIMEOUT). Last lines of {self.log_path}:\n{tail(self.log_path, 30)}")

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(base_url=f"http://127.0.0.1:{self.inference_port}",
                                      headers={"authorization": f"Bearer {self.api_key}"},
                                      timeout=httpx.Timeout(self.settings.request_timeout, connect=10.0))
        return self._http

    def _post(self, path: str, **kwargs) -> None:
        response = self._client().post(path, **kwargs)
        if response.status_code >= 400:
            raise EngineError(f"vLLM answered {response.status_code} to {path}: {_detail(response)}. "
                              f"See {self.log_path}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or body)

