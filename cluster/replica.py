"""A worker node's replica server (`python -m art_sky.cluster --join HEAD_URL`): the node's engine behind its own /v1,
no trainer, in the head's inference fleet (cluster/inference/fleet.py).

The head tells it which model to serve at which step (POST /fleet/models); it fetches that step's adapter from the
head (GET /fleet/models/{name}/steps/{step}/{file}, over the cluster's private network) into its own checkpoint
directory and serves it by exact name, `name@step`. `Membership` keeps the node in the fleet: it joins at start
(a refused join ends the server, saying why), joins again whenever the head's fleet no longer lists it (the head
restarted, or dropped it after missed checks), and runs the node's share of the trainer's ranks when the head's
trainer has a rendezvous (`WorkerRanks`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

import art_sky
from art_sky.checkpoints import CheckpointDir
from art_sky.errors import ArtSkyError, EngineError
from art_sky.settings import Settings
from art_sky.wire import HealthResponse, JoinReply, JoinRequest, ModelInfo, RegisterRequest, ReplicaModel

from .activity import ModelActivity
from .auth import api_key_auth
from .http_status import error_response
from .inference import openai_api
from .inference.fleet import ADAPTER_FILES
from .inference.gate import DeviceGate
from .inference.portable_engine import PortableEngine
from .model_state import ADAPTER, ModelState, device, load_peft, load_shape
from .node.placement import Placement
from .node.selection import select_engine
from .training.rank_group import WorkerRanks

log = logging.getLogger("art_sky.cluster")
CHECK_EVERY = 5.0  # seconds between a replica's checks that the head still lists it


def create_replica_app(
    art_path: Path, api_key: str, settings: Settings, placement: Placement, head_url: str
) -> FastAPI:
    engine = select_engine(settings, art_path, api_key, placement)
    samples_here = isinstance(engine, PortableEngine)  # it samples from the model in this process
    states: dict[str, ModelState] = {}
    activities: dict[str, ModelActivity] = {}
    gate = DeviceGate()
    loading = asyncio.Lock()  # one model or step loads at a time
    bearer, has_key, authorized = api_key_auth(api_key)
    guarded = [Depends(authorized)]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await engine.aclose()
            await asyncio.to_thread(engine.close)

    app = FastAPI(
        title="art-sky replica server",
        version=art_sky.__version__,
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.engine = engine.name  # what it tells the head when it joins

    @app.exception_handler(ArtSkyError)
    async def _art_sky_error(request: Request, exc: ArtSkyError) -> JSONResponse:
        status, body = error_response(exc)
        return JSONResponse(body.model_dump(), status_code=status)

    @app.get("/health")
    async def health(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> HealthResponse:
        if not has_key(credentials):
            return HealthResponse(version=art_sky.__version__)
        return HealthResponse(
            version=art_sky.__version__,
            engine=engine.name,
            device=str(device()),
            models=sorted(states),
            engine_port=engine.engine_port,
            serves_while_training=engine.serves_while_training,
            placement=placement.describe(),
        )

    openai_api.install(app, engine, states, gate, api_key, guarded, activities)

    @app.post("/fleet/models", dependencies=guarded)
    async def serve(body: ReplicaModel) -> ModelInfo:
        """Serve the model at `body.step` (a step older than the one served is already superseded: a no-op)."""
        request, step = body.request, body.step
        async with loading:
            state = states.get(request.served)
            if state is not None and state.step >= step:
                return state.info()
            checkpoints = CheckpointDir(art_path, request.project, request.run)
            if step not in checkpoints.steps():
                await asyncio.to_thread(_fetch, head_url, api_key, checkpoints, request, step)
            if state is None:
                engine.check(request)
                state = await asyncio.to_thread(_load, request, settings, checkpoints, step, samples_here)
                async with gate.exclusive():
                    await asyncio.to_thread(engine.attach, state)
                    activities[request.served] = ModelActivity(gate, [])
                    states[request.served] = state
            else:
                if samples_here:  # the engine copies the new LoRA from this model when it swaps
                    await asyncio.to_thread(_load_adapter, state.model, checkpoints.step_dir(step))
                async with gate.exclusive():
                    state.step = step
                    await asyncio.to_thread(engine.resume, state, True)
            await asyncio.to_thread(checkpoints.delete, [s for s in checkpoints.steps() if s != step])
        log.info("serving %s@%d", request.served, step)
        return state.info()

    return app


def _fetch(head_url: str, api_key: str, checkpoints: CheckpointDir, request: RegisterRequest, step: int) -> None:
    """The step's adapter files from the head, saved as this node's checkpoint of the step (with its manifest)."""
    name = request.served

    def write(directory: Path) -> None:
        with httpx.Client(
            base_url=head_url, headers={"authorization": f"Bearer {api_key}"}, timeout=httpx.Timeout(30.0, read=300.0)
        ) as client:
            for file in ADAPTER_FILES:
                with client.stream("GET", f"/fleet/models/{name}/steps/{step}/{file}") as response:
                    if response.status_code != 200:
                        raise EngineError(
                            f"the head did not send {file} of {name}@{step} "
                            f"({response.status_code}: {response.read()[:300]!r})"
                        )
                    with open(directory / file, "wb") as out:
                        for chunk in response.iter_bytes(1 << 20):
                            out.write(chunk)

    try:
        checkpoints.save(step, write, base_model=request.base_model)
    except httpx.HTTPError as exc:
        raise EngineError(f"cannot fetch {name}@{step} from the head at {head_url}: {exc!r}") from exc


def _load(
    request: RegisterRequest, settings: Settings, checkpoints: CheckpointDir, step: int, samples_here: bool
) -> ModelState:
    """The model as the engine needs it: the base with the step's LoRA (the portable engine samples from it), or
    only its shape and tokenizer (vLLM loads the weights itself)."""
    if samples_here:
        model, tokenizer = load_peft(request, settings, checkpoints.step_dir(step))
        model.eval()
    else:
        model, tokenizer = load_shape(request, settings)
    return ModelState(request, model, tokenizer, checkpoints, step=step)


def _load_adapter(model, step_dir: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(str(step_dir / "adapter_model.safetensors")), adapter_name=ADAPTER)


class JoinError(ArtSkyError):
    """The head refused this replica, or cannot be reached: the message says what to fix."""


class HeadUnreachable(JoinError):
    """The head does not answer (yet): a new cluster starts every node's script at once."""


class Membership:
    """This node in the head's fleet, and its share of the trainer's ranks while the head's trainer has one."""

    def __init__(self, head_url: str, api_key: str, request: JoinRequest):
        self.head_url, self.request = head_url.rstrip("/"), request
        self.client = httpx.Client(base_url=self.head_url, headers={"authorization": f"Bearer {api_key}"}, timeout=30.0)
        self.ranks: WorkerRanks | None = None
        self._stopped = threading.Event()

    def join(self) -> None:
        """Join the head's fleet (JoinError says why not); start or move this node's trainer ranks as it says."""
        try:
            response = self.client.post("/fleet/join", json=self.request.model_dump(mode="json"))
        except httpx.HTTPError as exc:
            raise HeadUnreachable(
                f"cannot reach the head at {self.head_url} ({exc!r}): check --join's URL, and "
                "that the head's server listens on the cluster's private network (its --host)"
            ) from exc
        if response.status_code == 401:
            raise JoinError(
                f"the head at {self.head_url} refused this node's API key: start it with the head's ART_SKY_API_KEY"
            )
        if response.status_code != 200:
            raise JoinError(
                f"the head at {self.head_url} refused to take this replica ({response.status_code}): "
                f"{response.json().get('detail') if _is_json(response) else response.text[:300]}"
            )
        trainer = JoinReply.model_validate_json(response.content).trainer
        if self.ranks is not None and self.ranks.rendezvous != trainer:
            self.ranks.close()
            self.ranks = None
        if trainer is not None and self.ranks is None:
            self.ranks = WorkerRanks(trainer)
        log.info("joined the fleet of %s as %s", self.head_url, self.request.url)

    def join_once_up(self, timeout: float) -> None:
        """`join`, retried while the head does not answer, for up to `timeout` s: SkyPilot starts every node at
        once, and the head loads before it listens. A refusal is final at once."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.join()
            except HeadUnreachable as exc:
                if time.monotonic() > deadline or self._stopped.is_set():
                    raise HeadUnreachable(f"{exc}; tried for {timeout:.0f} s (ART_SKY_SERVER_START_TIMEOUT)") from exc
                log.info("the head at %s does not answer yet: trying again", self.head_url)
                self._stopped.wait(1.0)

    def stay(self) -> None:
        """(A thread, until `close`.) Join again whenever the head's fleet does not list this replica."""
        while not self._stopped.wait(CHECK_EVERY):
            try:
                fleet = HealthResponse.model_validate_json(self.client.get("/health").content).fleet
                if self.request.url not in [replica.url for replica in fleet]:
                    log.warning("the head's fleet does not list this replica: joining again")
                    self.join()
            except (httpx.HTTPError, ValueError, JoinError) as exc:
                log.warning("the head at %s: %s", self.head_url, exc)

    def close(self) -> None:
        self._stopped.set()
        if self.ranks is not None:
            self.ranks.close()
        self.client.close()


def _is_json(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("application/json")
