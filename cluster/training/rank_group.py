"""The server's side of the sharded trainer: torchrun started on this node, the leading rank's socket, one command at
a time, and the trainer interface the server's steps call (`ShardedTrainer`, with each model's `RankWeights`).

torchrun (`torch.distributed.run`) launches the ranks, meets the other nodes' ranks at the rendezvous (c10d, hosted
here: the worker nodes' torchrun joins it, see `rendezvous`), and restarts the whole group when a rank fails. After
a restart the leader connects again and every model the server holds is loaded again from its newest committed
checkpoint before the next command, so a failed step leaves nothing behind on any rank. When torchrun itself ends
(its restarts used up), the next command starts it again.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch

from art_sky import capacity
from art_sky.errors import ArtSkyError, ConfigError, ErrorCode
from art_sky.files import TEMP_PREFIX
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest, TrainConfig, TrainerRendezvous

from ..checkpoint_writer import StagedFiles
from ..model_state import ADAPTER, ModelState, load_peft, load_shape
from ..node.placement import base_parameters
from ..processes import free_port, start_child, stop_group
from .activations import refuse_unfit
from .peft_trainer import Progress
from .rank_commands import RankCommand, RankReply, RankSequence
from .sequences import Sequence
from .sharded import KEY_ENV, LEADER_ENV

log = logging.getLogger("art_sky.cluster")


# Each round of ranks gets a store of its own (rank 0's): in the store torchrun's agents share by default, gloo's
# keys outlive a restart and the next round's ranks read the dead round's addresses (they hang or fail to connect).
# PYTHONSAFEPATH: the ranks (`python -m`) import art-sky as installed, not a folder of that name where they start.
RANKS_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONSAFEPATH": "1"}
NODE_HEARTBEAT = 2  # seconds between a node's heartbeats at the rendezvous
LAST_CALL = 3  # seconds a rendezvous with enough nodes waits for more (every live node's agent rejoins well within)
WORKER_WAIT = 86400  # seconds a worker's torchrun waits for the head's rendezvous (it is there once the head trains)


_REPEATABLE = {"snapshot", "load", "drop"}  # commands that change nothing a restart does not redo: sent again


class RankError(ArtSkyError):
    """The trainer's ranks failed a command: `intact`, every rank's shards are as they were before the failure;
    otherwise the ranks restart from the last commit."""

    code = ErrorCode.ROLLED_BACK

    def __init__(self, message: str, intact: bool = False):
        super().__init__(message)
        self.intact = intact


class RankGroup:
    """torchrun on this node and a socket to its leading rank. `request` sends one command and waits for the
    answer; `loaded` remembers how to load each model again after a restart."""

    def __init__(self, settings: Settings, ranks_per_node: int, env: dict[str, str] | None = None):
        self.settings, self.ranks_per_node = settings, ranks_per_node
        self.env = env or {}
        self.key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.rendezvous = TrainerRendezvous(
            endpoint=f"{settings.rendezvous_host}:{free_port(settings.rendezvous_host)}",
            run_id=secrets.token_hex(8),
            nodes=settings.nodes,
            ranks_per_node=ranks_per_node,
            max_restarts=settings.trainer_max_restarts,
        )
        self.generation = 0  # moves on when the ranks fail and when the leader connects (again)
        self.min_nodes = 1  # the fewest nodes the ranks go on with: the nodes the largest model needs (its shards)
        self.loaded: dict[str, Callable[[], RankCommand]] = {}
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self._connected = threading.Condition()
        self._lock = threading.Lock()  # one command at a time
        self._closed = False
        self._fresh = False  # a new connection: the models are loaded again before the next command
        # what the server knows of a worker node lost with the ranks (its fleet's word), or ""
        self.lost_nodes: Callable[[], str] = lambda: ""
        threading.Thread(target=self._accept, daemon=True, name="rank-leader").start()

    def request(self, command: RankCommand, progress: Progress = lambda done, total: None) -> RankReply:
        """Run `command` on every rank; RankError if a rank fails (the group restarts, unless the reply says the
        ranks are intact). A command that changes nothing (a step's snapshot, a load) whose ranks restarted under
        it, as when a worker node rejoins, waits for the new ranks and runs again. Blocking: a worker thread."""
        with self._lock:
            retried = False
            while True:
                connection = self._ready()
                cause: Exception | None  # the lost connection's error; None where a rank said what failed
                try:
                    reply = self._exchange(connection, command, progress)
                except (EOFError, OSError) as exc:
                    self._lost(connection)
                    failure, cause = f"the trainer's ranks stopped during {command.kind}: {self._what_stopped()}", exc
                else:
                    if reply.kind != "error":
                        return reply
                    if reply.intact:
                        raise RankError(reply.message, intact=True)
                    self._lost(connection)
                    failure, cause = reply.message, None
                if command.kind in _REPEATABLE and not retried:  # the group was restarting as it was sent
                    retried = True
                    log.warning(
                        "the trainer's ranks restarted under %s (%s): sending it again once they are back",
                        command.kind,
                        failure,
                    )
                    continue
                raise RankError(self._said(failure)) from cause

    @staticmethod
    def _exchange(connection: Connection, command: RankCommand, progress: Progress) -> RankReply:
        """Send `command`; its progress lines go to `progress`; its last reply (done or error) is returned."""
        connection.send_bytes(command.model_dump_json().encode())
        while (reply := RankReply.model_validate_json(connection.recv_bytes())).kind == "progress":
            progress(reply.done, reply.total)
        return reply

    def close(self) -> None:
        """Stop the ranks (asked first, then torchrun's process group)."""
        self._closed = True
        with self._connected:
            connection, self._connection = self._connection, None
            self._connected.notify_all()
        asked = False
        if connection is not None:
            try:
                connection.send_bytes(RankCommand(kind="stop").model_dump_json().encode())
                asked = True
            except OSError:
                pass
        if self._process is not None:
            stop_group(self._process, asked=asked)
        self._listener.close()

    def _ready(self) -> Connection:
        """The leader's socket: torchrun started (again) if it is not running, and after a (re)connection every
        loaded model loaded again before anything else."""
        deadline = time.monotonic() + self.settings.server_start_timeout
        with self._connected:
            if self._connection is not None and self._connection.poll():  # closed while idle: the ranks restarted
                self._connection.close()
                self._connection = None
                self.generation += 1
            while self._connection is None:
                if self._closed:
                    raise RankError("the trainer's ranks are stopping with the server")
                if self._process is None or self._process.poll() is not None:
                    self._start()
                if time.monotonic() > deadline:
                    raise RankError(self._not_ready())
                self._connected.wait(1.0)
            connection, fresh = self._connection, self._fresh
            self._fresh = False
        if fresh:
            try:
                for name, load in list(self.loaded.items()):
                    log.info("trainer ranks (generation %d): loading %s again", self.generation, name)
                    self._send(connection, load())
            except (EOFError, OSError):  # they restarted again meanwhile: wait for the next ones
                self._lost(connection)
                return self._ready()
        return connection

    def _send(self, connection: Connection, command: RankCommand) -> None:
        reply = self._exchange(connection, command, lambda done, total: None)
        if reply.kind == "error":
            self._lost(connection)
            raise RankError(
                self._said(f"reloading {command.name} on the trainer's restarted ranks failed: {reply.message}")
            )

    def _what_stopped(self) -> str:
        """Which part of the group stopped, as far as the server can tell."""
        code = self._process.poll() if self._process is not None else None
        if code is not None:
            return (
                f"torchrun on this node exited (code {code}): its {self.rendezvous.max_restarts} restarts "
                "(ART_SKY_TRAINER_MAX_RESTARTS) are used up, or it could not start; the next command starts it "
                "again"
            )
        return "the leading rank's connection closed (a rank stopped, on this node or another)"

    def _said(self, what: str) -> str:
        """A failure that restarts the ranks: which node was lost (the fleet's word), and what happens next."""
        lost = self.lost_nodes()
        node = f" A worker node was lost, and its ranks with it: {lost}." if lost else ""
        nodes = " (on the nodes that remain)" if self.rendezvous.nodes > 1 else ""
        return (
            f"{what}.{node} torchrun restarts the ranks{nodes}, which reload the last committed step; the next "
            f"step waits for them up to {self.settings.server_start_timeout:.0f} s (ART_SKY_SERVER_START_TIMEOUT):"
            " train again"
        )

    def _start(self) -> None:
        address = self._listener.address
        env = os.environ | self.env | RANKS_ENV | {LEADER_ENV: f"{address[0]}:{address[1]}", KEY_ENV: self.key.hex()}
        log.info(
            "starting the trainer's ranks: %d per node on %d node(s), rendezvous at %s",
            self.ranks_per_node,
            self.rendezvous.nodes,
            self.rendezvous.endpoint,
        )
        self._process = start_child(torchrun(self.rendezvous, self.min_nodes), env=env, stdin=subprocess.DEVNULL)

    def _not_ready(self) -> str:
        waiting = (
            f" (the models' shards need {self.min_nodes} of the cluster's {self.rendezvous.nodes} nodes: "
            f"waiting for lost ones to be replaced, at the rendezvous at {self.rendezvous.endpoint})"
            if self.min_nodes > 1
            else ""
        )
        return (
            f"the trainer's ranks did not start within {self.settings.server_start_timeout:.0f} s{waiting}: "
            "see the server log for torchrun's output"
        )

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection = self._listener.accept()
            except (OSError, EOFError):  # closed, or a caller without the key
                if self._closed:
                    return
                continue
            with self._connected:
                self.generation += 1
                self._connection, self._fresh = connection, True
                self._connected.notify_all()

    def _lost(self, connection: Connection) -> None:
        """The ranks failed: they restart from the last commit, which a snapshot taken before cannot undo."""
        with self._connected:
            if self._connection is connection:
                self._connection = None
                self.generation += 1
        connection.close()


class RankWeights:
    """A model's LoRA and AdamW, sharded over the ranks; with the server's own copy of the model (the portable
    engine serves from it) kept equal to the trained LoRA."""

    def __init__(self, group: RankGroup, state: ModelState, mirrored: bool):
        self.group, self.state, self.mirrored = group, state, mirrored

    def snapshot(self) -> tuple[int, list[torch.Tensor]]:
        self.group.request(RankCommand(kind="snapshot", name=self.state.name))
        return self.group.generation, [p.detach().clone() for p in self._mirror()]

    def restore(self, saved: tuple[int, list[torch.Tensor]]) -> None:
        generation, mirror = saved
        with torch.no_grad():
            for param, value in zip(self._mirror(), mirror, strict=True):
                param.copy_(value)
        if generation == self.group.generation:  # else the ranks restarted and reloaded the last commit
            self.group.request(RankCommand(kind="restore", name=self.state.name))

    def stage(self, optimizer: bool = True) -> StagedFiles:
        """The ranks write the step's adapter (and with `optimizer` the optimizer's state) now, into a directory of
        its own beside the checkpoints (the gathered state is the ranks' until then); the checkpoint links them in."""
        self.state.checkpoints.path.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}ranks-", dir=self.state.checkpoints.path))
        try:
            self.save(directory, optimizer)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return StagedFiles(directory)

    def save(self, directory: Path, optimizer: bool = True) -> None:
        try:
            self.group.request(
                RankCommand(kind="save", name=self.state.name, directory=str(directory), optimizer=optimizer)
            )
        except RankError as exc:
            if exc.intact:  # the step says the checkpoint could not be written, and why
                raise OSError(str(exc)) from exc
            raise
        if self.mirrored:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(
                self.state.model, load_file(str(directory / "adapter_model.safetensors")), adapter_name=ADAPTER
            )

    def _mirror(self) -> list[torch.Tensor]:
        return [p for p in self.state.model.parameters() if p.requires_grad] if self.mirrored else []


class ShardedTrainer:
    """The trainer interface (as PeftTrainer's) over the ranks. `mirrored`: the server keeps its own copy of each
    model (base and LoRA) for an engine that samples from it in this process; otherwise it holds only the model's
    shape (on the meta device) and the tokenizer."""

    name = "sharded"

    def __init__(self, group: RankGroup, mirrored: bool, gpu_memory_bytes: int | None = None):
        self.group, self.mirrored = group, mirrored
        self.capacity = (
            capacity.Layout(gpu_memory_bytes, group.rendezvous.nodes, engine_gpus=0, trainer_gpus=group.ranks_per_node)
            if gpu_memory_bytes
            else None
        )
        self.ranks = group.ranks_per_node * group.rendezvous.nodes
        self.rendezvous = group.rendezvous  # what a worker node is told when it joins

    def load_model(self, request: RegisterRequest, settings: Settings, checkpoint: Path | None) -> tuple[Any, Any]:
        """The server's copy: the whole model (mirrored), else its shape; refused when its shards do not fit the
        trainer's GPUs."""
        model, tokenizer = load_peft(request, settings, checkpoint) if self.mirrored else load_shape(request, settings)
        problem = self.capacity.problem(base_parameters(model)) if self.capacity else None
        if problem:
            raise ConfigError(
                f"{request.base_model} does not fit this cluster: {problem}. Start a cluster with more "
                "trainer GPUs (ART_SKY_TRAINER_GPUS, more nodes) or larger ones, or train a smaller "
                "model"
            )
        if self.capacity:
            refuse_unfit(
                request,
                model,
                base_parameters(model),
                self.capacity.trainer_ranks,
                self.capacity.gpu_memory_bytes,
                settings.train_microbatch_tokens,
                settings.activation_checkpointing,
            )
            # after losing nodes, the ranks go on only with enough of them for this model's shards
            needed = next(
                n
                for n in range(1, self.capacity.nodes + 1)
                if replace(self.capacity, nodes=n).problem(base_parameters(model)) is None
            )
            self.group.min_nodes = max(self.group.min_nodes, needed)
        return model, tokenizer

    def load_weights(self, state: ModelState, step_dir: Path | None) -> RankWeights:
        """Load the model on the ranks (from `step_dir`, or a fresh LoRA), and again from its newest committed
        step whenever the ranks restart."""
        name, request = state.name, state.request
        self.group.request(
            RankCommand(kind="load", name=name, request=request, checkpoint=str(step_dir) if step_dir else None)
        )
        self.group.loaded[name] = lambda: _reload(state)
        return RankWeights(self.group, state, self.mirrored)

    def train(
        self,
        state: ModelState,
        sequences: list[Sequence],
        config: TrainConfig,
        progress: Progress = lambda done, total: None,
    ) -> dict[str, float]:
        return self.group.request(
            RankCommand(
                kind="train", name=state.name, config=config, sequences=[RankSequence.of(s) for s in sequences]
            ),
            progress,
        ).metrics

    def sft(
        self,
        state: ModelState,
        batches: list[list[Sequence]],
        learning_rates: list[float],
        max_grad_norm: float,
        progress: Progress = lambda done, total: None,
    ) -> list[dict[str, float]]:
        return self.group.request(
            RankCommand(
                kind="sft",
                name=state.name,
                batches=[[RankSequence.of(s) for s in batch] for batch in batches],
                learning_rates=learning_rates,
                max_grad_norm=max_grad_norm,
            ),
            progress,
        ).batches

    def close(self) -> None:
        self.group.close()


class WorkerRanks:
    """A worker node's share of the trainer's ranks: its torchrun joins the head's rendezvous, and is started again
    whenever it ends (its restarts used up, or the head's group started anew) until `close`."""

    def __init__(self, rendezvous: TrainerRendezvous, env: dict[str, str] | None = None):
        self.rendezvous, self.env = rendezvous, env or {}
        self._process: subprocess.Popen | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="worker-ranks")
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._process is not None:
            stop_group(self._process)
        self._thread.join(15)

    def _run(self) -> None:
        while not self._closed.is_set():
            log.info(
                "joining the trainer's rendezvous at %s with %d rank(s)",
                self.rendezvous.endpoint,
                self.rendezvous.ranks_per_node,
            )
            self._process = start_child(
                torchrun(self.rendezvous), env=os.environ | self.env | RANKS_ENV, stdin=subprocess.DEVNULL
            )
            code = self._process.wait()
            if not self._closed.is_set():
                log.warning("this node's trainer ranks ended (exit %s): joining again", code)
                self._closed.wait(2.0)


def torchrun(rendezvous: TrainerRendezvous, min_nodes: int | None = None) -> list[str]:
    """The same torchrun on every node; the head's (`min_nodes` given) hosts the rendezvous and tells its leading
    rank where the server listens (env). Several nodes meet in torchrun's elastic range: a node lost (no heartbeat
    for 3 * NODE_HEARTBEAT s) leaves the group, which goes on after LAST_CALL s with the nodes that remain, down to
    the head's `min_nodes` (fewer: it waits for a replacement); a node that joins (again) is taken in at once (the
    group restarts, reloading the last commit). A worker waits for the head's rendezvous as long as it takes."""
    head = min_nodes is not None
    nodes = f"{min_nodes or 1}:{rendezvous.nodes}" if rendezvous.nodes > 1 else "1"
    conf = f"is_host={int(head)},last_call_timeout={LAST_CALL},keep_alive_interval={NODE_HEARTBEAT}," + (
        "keep_alive_max_attempt=3" if head else f"keep_alive_max_attempt=3,read_timeout={WORKER_WAIT}"
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={rendezvous.ranks_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous.endpoint}",
        f"--rdzv-id={rendezvous.run_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={rendezvous.max_restarts}",
        "-m",
        "art_sky.cluster.training.sharded",
    ]


def _reload(state: ModelState) -> RankCommand:
    """The model's newest step, once on disk (its background write waited for)."""
    state.writer.flush()
    steps = state.checkpoints.steps()
    return RankCommand(
        kind="load",
        name=state.name,
        request=state.request,
        checkpoint=str(state.checkpoints.step_dir(steps[-1])) if steps else None,
    )
