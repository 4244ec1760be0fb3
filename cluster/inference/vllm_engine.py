"""The vLLM engine: vLLM's own OpenAI server as a child process, behind the cluster server's /v1.

The cluster server's /v1 is an async streaming proxy in front of vLLM (one port and one tunnel for the laptop):
it routes a model's name to its newest step, refuses what vLLM would silently ignore, and passes vLLM's
responses and server-sent events through, with the prompt and sampled token ids the trainer needs. vLLM starts
at the first registration, when the base model is known, and serves that one base model.

Each trained step is its own LoRA adapter in vLLM, named `name@step`, never reloaded under a name it had before:
vLLM's prefix cache keys KV blocks by adapter, and an adapter swapped under one name can reuse blocks computed
with the old weights (vLLM issue #42125). After a step the new adapter is loaded, the model's name routes to it
and the previous one is unloaded; older steps load on demand as `name@step`, at most ART_SKY_VLLM_MAX_LORAS at
once (least recently used ones are unloaded first). While a model trains, vLLM keeps serving the previous step's
adapter; requests wait at the proxy only while the new one is swapped in. On a GPU it shares with the trainer it
sleeps instead for the whole step (sleep mode), so the trainer gets its GPU memory back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

import aiohttp
import httpx

from art_sky.errors import ConfigError, ConflictError, EngineError
from art_sky.files import tail
from art_sky.layout import step_name
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest

from ..model_state import ModelState, device, resolve_base_model
from ..node.placement import Placement, base_parameters
from ..processes import free_port, start_child, stop_group
from .gate import Hold
from .openai_api import SSE, OpenAIError, Served
from .tool_parsers import parser_name

log = logging.getLogger("art_sky.cluster")

# vLLM accepts only these LoRA rank limits (vllm.config.lora.MaxLoRARanks).
_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmEngine:
    name = "vllm"

    def __init__(self, settings: Settings, art_path: Path, api_key: str, placement: Placement | None = None):
        self.settings, self.api_key = settings, api_key
        self.placement = placement or Placement("shared" if device().type == "cuda" else "cpu")
        self.log_path = Path(art_path) / "logs" / "vllm.log"
        # vLLM sleeps while a step trains only where it shares the GPU with the trainer (sleep needs CUDA's
        # allocator); on GPUs of its own (the dedicated layout) it never sleeps or pauses
        self.sleep_mode = device().type == "cuda" and self.placement.layout != "dedicated"
        self.engine_port: int | None = None
        self.base_model: str | None = None
        self.max_lora_rank = 0
        self.reasoning_parser: str | None = None  # vLLM's --reasoning-parser: the first model's, one per child
        self.honoured: frozenset[str] = frozenset()  # vLLM's own chat request fields, read from its OpenAPI schema
        self._process: subprocess.Popen | None = None
        self._http: httpx.Client | None = None  # control calls, from the server's worker threads
        self._http_async: aiohttp.ClientSession | None = None  # completions, on the event loop
        self._loaded: OrderedDict[str, None] = OrderedDict()  # adapters in vLLM, least recently used first
        self._current: dict[str, str] = {}  # model name -> the adapter of its newest step
        self._inflight: Counter[str] = Counter()  # adapter -> completions using it now
        self._loading: asyncio.Lock | None = None

    # -- the server's hooks ------------------------------------------------------------------------------------

    def check(self, request: RegisterRequest) -> None:
        """Before a model is loaded: can the running vLLM serve it? (One base model, its LoRA rank limit.)"""
        if self._process is None:
            return
        if request.base_model != self.base_model:
            raise ConfigError(
                f"this server's vLLM serves {self.base_model!r}; model {request.name!r} is on "
                f"{request.base_model!r}: use one base model per cluster server"
            )
        if request.config.lora_rank > self.max_lora_rank:
            raise ConfigError(
                f"model {request.name!r} has LoRA rank {request.config.lora_rank} but this server's "
                f"vLLM was started with --max-lora-rank {self.max_lora_rank}: register it on a "
                "fresh server"
            )
        if request.config.reasoning_parser != self.reasoning_parser:
            raise ConflictError(
                f"model {request.name!r} asks for reasoning parser {request.config.reasoning_parser!r} but this "
                f"server's vLLM (one per base model) was started with {self.reasoning_parser!r}: register it with "
                "the same reasoning_parser, or on a fresh server"
            )

    def attach(self, state: ModelState) -> None:
        """Serve a newly registered model: start vLLM on its base model if needed, load its current step."""
        if self._process is None:
            self._start(state)
        self._serve_newest(state)

    @property
    def serves_while_training(self) -> bool:
        """vLLM is its own process with its own memory unless it shares a GPU with the trainer (sleep mode): then
        it sleeps for the step; otherwise it goes on serving the previous adapter while the trainer trains."""
        return not self.sleep_mode

    def pause(self) -> None:
        """Before a training step, on a GPU shared with the trainer (no completion in flight: the gate drained
        them): vLLM sleeps, its weights and KV cache out of GPU memory."""
        self._post("/sleep", params={"level": 1, "mode": "wait"})

    def resume(self, state: ModelState, trained: bool) -> None:
        """After a training step (no completion in flight): wake up if asleep, then serve the new step's adapter
        under the model's name."""
        if self.sleep_mode:
            self._post("/wake_up")
        if trained:
            self._serve_newest(state)

    def close(self) -> None:
        """Stop vLLM and its engine processes (its own process group)."""
        process, self._process = self._process, None
        if self._http is not None:
            self._http.close()
            self._http = None
        if process is None:
            return
        stop_group(process)  # its engine's processes too
        log.info("vLLM stopped")

    # -- the OpenAI route: a streaming proxy ---------------------------------------------------------------------

    async def chat(self, served: Served, body: dict, hold: Hold) -> bytes | SSE:
        """Forward one chat completion to vLLM under the served step's adapter. Non-streaming: the response, with
        the prompt's token ids and the served step (`art_sky_step`) on each choice (a trajectory keeps choices, not
        completions). Streaming: vLLM's events as they come (the prompt ids ride on the first one; each event's
        `model` is the adapter, `name@step`)."""
        adapter = await self._use(served)
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                hold.release()
                self._inflight[adapter] -= 1

        body["model"] = adapter
        if body.get("return_token_ids") is None:  # ids unless refused: any client's choices then train exactly
            body["return_token_ids"] = True
        stream = bool(body.get("stream"))
        try:
            try:
                response = await self._session().post(
                    "/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
                )
            except (aiohttp.ClientError, OSError) as exc:
                raise OpenAIError(
                    503, f"vLLM did not answer ({exc!r}); see {self.log_path}", type="server_error"
                ) from exc
            if response.status >= 400:
                text = await response.text()
                response.release()
                raise OpenAIError(response.status, f"vLLM: {_message(text)}", param=_param(text), type="vllm_error")
            if not stream:
                content = await response.read()
                finish()
                completion = json.loads(content)
                for choice in completion.get("choices", []):
                    if completion.get("prompt_token_ids") is not None:
                        choice["prompt_token_ids"] = completion["prompt_token_ids"]
                    _name_reasoning(choice.get("message"))
                return json.dumps(served.label(completion)).encode()
        except BaseException:
            finish()
            raise

        async def close() -> None:
            finish()
            response.close()  # drops the connection: vLLM aborts a request whose client went away

        async def chunks():
            try:
                if not self.reasoning_parser:
                    async for raw in response.content.iter_any():
                        yield raw
                    return
                pending = b""  # whole SSE lines (an event with a long prompt's ids spans many reads)
                async for raw in response.content.iter_any():
                    *lines, pending = (pending + raw).split(b"\n")
                    if lines:
                        yield b"".join(reasoning_event(line) + b"\n" for line in lines)
                if pending:
                    yield reasoning_event(pending)
            finally:
                await close()

        return SSE(chunks(), close)

    async def aclose(self) -> None:
        """Close the completions' connection pool (on the event loop that made it)."""
        session, self._http_async = self._http_async, None
        if session is not None:
            await session.close()

    # -- adapters ----------------------------------------------------------------------------------------------

    def _serve_newest(self, state: ModelState) -> None:
        """(Worker thread, the device gate held alone.) Load the newest step as `name@step`, route the model's name
        to it, unload the adapter it replaces."""
        adapter, previous = f"{state.name}@{state.step}", self._current.get(state.name)
        if adapter not in self._loaded:
            self._post("/v1/load_lora_adapter", json={"lora_name": adapter, "lora_path": self._path(state, state.step)})
            self._loaded[adapter] = None
        self._current[state.name] = adapter
        if previous is not None and previous != adapter:
            self._unload(previous)
            self._loaded.pop(previous, None)
        log.info("vLLM serves %s as %s (%s)", state.name, adapter, step_name(state.step))

    async def _use(self, served: Served) -> str:
        """The adapter of the served step, loaded (an older step on first use) and counted as in use."""
        adapter = served.name
        if adapter not in self._loaded:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if adapter not in self._loaded:
                    await self._load_older(served)
        self._loaded.move_to_end(adapter)
        self._inflight[adapter] += 1
        return adapter

    async def _load_older(self, served: Served) -> None:
        pinned = set(self._current.values())
        while len(self._loaded) >= self.settings.vllm_max_loras:
            idle = [a for a in self._loaded if a not in pinned and not self._inflight[a]]
            if not idle:
                break  # every loaded adapter is in use: vLLM's own LRU makes room on the device
            async with self._session().post("/v1/unload_lora_adapter", json={"lora_name": idle[0]}) as response:
                if response.status not in (200, 404):
                    raise OpenAIError(
                        503,
                        f"vLLM refused to unload adapter {idle[0]!r}: {_message(await response.text())}",
                        type="server_error",
                    )
            del self._loaded[idle[0]]
        async with self._session().post(
            "/v1/load_lora_adapter", json={"lora_name": served.name, "lora_path": self._path(served.state, served.step)}
        ) as response:
            if response.status >= 400:
                raise OpenAIError(
                    503, f"vLLM could not load {served.name!r}: {_message(await response.text())}", type="server_error"
                )
        self._loaded[served.name] = None
        log.info("vLLM loaded %s on demand", served.name)

    @staticmethod
    def _path(state: ModelState, step: int) -> str:
        return str(state.adapter_dir(step).resolve())

    def _unload(self, lora_name: str) -> None:
        response = self._client().post("/v1/unload_lora_adapter", json={"lora_name": lora_name})
        if response.status_code not in (200, 404):  # 404: it was never loaded
            raise EngineError(f"vLLM refused to unload adapter {lora_name!r}: {_detail(response)}")

    # -- the child process -------------------------------------------------------------------------------------

    def _start(self, state: ModelState) -> None:
        rank = vllm_lora_rank(state.request.config.lora_rank)
        port = free_port()
        placement = self.placement.sized(state.model.config, base_parameters(state.model), self.settings)
        args, env = vllm_command(
            self.settings,
            placement,
            resolve_base_model(state.request.base_model, self.settings),
            state.request,
            port,
            rank,
            device().type == "cuda",
            self.sleep_mode,
            self.api_key,
            state.tokenizer.chat_template,
        )
        if not self.sleep_mode:
            log.info(
                "vLLM never sleeps here (%s): it serves the previous adapter while a step trains", placement.describe()
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM on %s (port %d, log %s)", state.request.base_model, port, self.log_path)
        with open(self.log_path, "ab") as out:
            self._process = start_child(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ | env)
        self.placement, self.engine_port, self.base_model, self.max_lora_rank, self.reasoning_parser = (
            placement,
            port,
            state.request.base_model,
            rank,
            state.request.config.reasoning_parser,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        started = time.monotonic()
        deadline = started + self.settings.vllm_start_timeout
        while time.monotonic() < deadline:
            process = self._process
            if process is None:  # `close` ran meanwhile (the server is stopping)
                raise EngineError("vLLM was stopped while it was starting: the server is shutting down")
            if process.poll() is not None:
                code = process.returncode
                self.close()
                raise EngineError(
                    f"vLLM exited with code {code} while starting. Last lines of "
                    f"{self.log_path}:\n{tail(self.log_path, 30)}"
                )
            try:
                if self._client().get("/health", timeout=5).status_code == 200:
                    log.info("vLLM ready in %.0fs", time.monotonic() - started)
                    self._read_parameters()
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.close()
        raise EngineError(
            f"vLLM was not ready within {self.settings.vllm_start_timeout:.0f}s "
            f"(ART_SKY_VLLM_START_TIMEOUT). Last lines of {self.log_path}:\n{tail(self.log_path, 30)}"
        )

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(
                base_url=f"http://127.0.0.1:{self.engine_port}",
                headers={"authorization": f"Bearer {self.api_key}"},
                timeout=httpx.Timeout(self.settings.request_timeout, connect=10.0),
            )
        return self._http

    def _session(self) -> aiohttp.ClientSession:
        """One pooled client for every completion: no connection limit (vLLM batches whatever comes), idle
        connections kept 30 s (vLLM keeps them 75 s, so none is reused while vLLM closes it). aiohttp, not httpx:
        its C parser and pool cost a fraction of httpx's CPU per request, which a proxy on the GPU node's few
        cores must not take from vLLM's own API server."""
        if self._http_async is None:
            self._http_async = aiohttp.ClientSession(
                base_url=f"http://127.0.0.1:{self.engine_port}",
                headers={"authorization": f"Bearer {self.api_key}"},
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout, sock_connect=10),
                auto_decompress=False,
            )
        return self._http_async

    def _read_parameters(self) -> None:
        """The chat completion fields this vLLM knows, from its OpenAPI schema: whatever version is installed,
        the proxy refuses exactly what vLLM would silently ignore."""
        response = self._client().get("/openapi.json", timeout=30)
        if response.status_code != 200:
            raise EngineError(
                f"vLLM did not serve its OpenAPI schema ({response.status_code}): art-sky reads the "
                "chat parameters vLLM honours from it. See {self.log_path}"
            )
        schemas = response.json().get("components", {}).get("schemas", {})
        fields = schemas.get("ChatCompletionRequest", {}).get("properties")
        if not fields:
            raise EngineError(
                "vLLM's OpenAPI schema has no ChatCompletionRequest: this vLLM version is not one "
                "art-sky knows; use the [gpu] extra's pinned vLLM"
            )
        self.honoured = frozenset(fields)

    def _post(self, path: str, **kwargs) -> None:
        response = self._client().post(path, **kwargs)
        if response.status_code >= 400:
            raise EngineError(
                f"vLLM answered {response.status_code} to {path}: {_detail(response)}. See {self.log_path}"
            )


# Constrained JSON without free whitespace, as the portable engine's (cluster/inference/constraints.py): vLLM honours
# it with a named backend only, not "auto"; xgrammar, because vLLM's tool calls need its structural tags (guidance
# refuses them). A schema feature xgrammar lacks (multipleOf, uniqueItems, some string formats) is then a 400.
_COMPACT_JSON = {"backend": "xgrammar", "disable_any_whitespace": True}


def vllm_command(
    settings: Settings,
    placement: Placement,
    source: str,
    request: RegisterRequest,
    port: int,
    lora_rank: int,
    on_cuda: bool,
    sleep_mode: bool,
    api_key: str,
    chat_template: str | dict | None = None,
) -> tuple[list[str], dict[str, str]]:
    """vLLM's command line and what its environment adds to the server's: the placement's GPUs and parallelism,
    sleep mode only where it shares a GPU, the API key in the environment (never on argv, where `ps` shows it).
    `python -m vllm.entrypoints.openai.api_server` is one API server process whatever the data-parallel size, so
    an adapter loaded at runtime is known to every request and reaches every replica."""
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        source,
        "--served-model-name",
        request.base_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-lora",
        "--max-lora-rank",
        str(lora_rank),
        "--max-loras",
        str(settings.vllm_max_loras),
        "--max-model-len",
        str(request.config.max_seq_length),
        *placement.engine_args(settings),
        # float32 on CPU: the logprobs it reports then equal the trainer's own (the PPO ratio starts at 1)
        "--dtype",
        "auto" if on_cuda else "float32",
        "--disable-uvicorn-access-log",
    ]
    if settings.vllm_compact_json:
        args += ["--structured-outputs-config", json.dumps(_COMPACT_JSON)]
    parser = parser_name(settings.tool_parser, chat_template)
    if parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    if request.config.reasoning_parser:
        args += ["--reasoning-parser", request.config.reasoning_parser]
    if sleep_mode:
        args.append("--enable-sleep-mode")
    env = {
        "VLLM_API_KEY": api_key,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",  # /sleep, /wake_up
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",  # the proxy's pool drops idle connections first (30 s)
    } | placement.engine_env()
    if not on_cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; vLLM's CPU default is far larger
    return args, env


def _name_reasoning(message: dict | None) -> None:
    """vLLM 0.32 calls the parsed reasoning `reasoning`; LangChain, litellm and the OpenAI SDK's users read
    `reasoning_content` (as the portable engine answers): a message or delta gets both."""
    if isinstance(message, dict) and message.get("reasoning") is not None and "reasoning_content" not in message:
        message["reasoning_content"] = message["reasoning"]


def reasoning_event(line: bytes) -> bytes:
    """One line of vLLM's event stream (without its newline) with each delta's reasoning also as
    `reasoning_content`; any other line as it came."""
    if not line.startswith(b"data: {") or b'"reasoning"' not in line:
        return line
    try:
        event = json.loads(line[6:])
    except ValueError:
        return line
    for choice in event.get("choices", []):
        _name_reasoning(choice.get("delta"))
    return b"data: " + json.dumps(event).encode()


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds a LoRA of `rank`."""
    allowed = next((r for r in _MAX_LORA_RANKS if r >= rank), None)
    if allowed is None:
        raise ConfigError(f"LoRA rank {rank} is above vLLM's limit {_MAX_LORA_RANKS[-1]}")
    return allowed


def _error(text: str) -> dict:
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _param(text: str) -> str | None:
    error = _error(text).get("error")
    return error.get("param") if isinstance(error, dict) else None


def _message(text: str) -> str:
    body = _error(text)
    error = body.get("error", body) if body else text
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error or text)


def _detail(response: httpx.Response) -> str:
    return _message(response.text)
