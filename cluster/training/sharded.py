"""The trainer as ranks: `python -m art_sky.cluster.training.sharded`, started by torchrun on every node, one rank
per trainer GPU (or CPU rank). Each registered model is one PEFT LoRA on its base model, sharded over all the ranks
with FSDP2 (`fully_shard` on every decoder layer and the root): base weights, LoRA and AdamW state each split N ways.

The head node's first local rank leads: it holds the server's socket (cluster/training/rank_group.py), reads each
command and shares it with the other ranks over a gloo group of its own, which may wait between steps for as long as
rollouts take; the training collectives run on the default group, whose timeout bounds how long a dead rank goes
unnoticed. Any rank that fails a command exits: the others' collectives fail, torchrun restarts the whole group,
and the server has every rank reload its models' last committed checkpoints. One failure every rank sees without
having changed its shards (the leader cannot write a checkpoint: a full disk) is answered as an error, and the
server asks every rank to restore its snapshot.

Loading: rank 0 reads the base weights into host memory, every other rank builds the model on the meta device, and
`set_model_state_dict(..., broadcast_from_rank0=True)` fills each rank's shards: one copy of the weights in host
memory for the cluster. A checkpoint's adapter and optimizer state are read by the leader (they are on the head
node's disk) and shared with the ranks. Saving gathers the LoRA's full tensors and the optimizer's full state on
every rank (small beside the base), and the leader writes them in PEFT's layout.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from art_sky.settings import Settings

from ..model_state import LORA_SEED, lora_config, resolve_base_model
from . import weights
from .packing import use_packed_attention
from .peft_trainer import PeftTrainer, Policy, pad_id
from .rank_commands import RankCommand, RankReply
from .sequences import Sequence
from .weights import ADAPTER

LEADER_ENV = "ART_SKY_RANK_LEADER"  # host:port of the server's socket; set on the head node's torchrun alone
KEY_ENV = "ART_SKY_RANK_KEY"  # the socket's key (hex), beside it
CONTROL_TIMEOUT = timedelta(days=365)  # commands may be hours apart (the rollouts between steps)
# what a collective says when a peer is gone (gloo's transport, NCCL's watchdog, a store): another rank stopped
_LOST_PEER = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "gloo/transport",
    "Timed out",
    "timed out",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
)


@dataclass
class Sharded:
    model: Any  # PeftModel whose parameters are DTensor shards
    optimizer: torch.optim.Optimizer
    policy: Policy
    snapshot: weights.Snapshot | None = None  # the rollback point of this rank's shards


class Ranks:
    """This rank's models and how it runs each command."""

    def __init__(self, settings: Settings, leader: int, control: dist.ProcessGroup):
        self.settings, self.leader, self.control = settings, leader, control
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.trainer = PeftTrainer(settings.train_microbatch_tokens, settings.activation_checkpointing)
        self.models: dict[str, Sharded] = {}

    @property
    def leads(self) -> bool:
        return self.rank == self.leader

    def run(self, command: RankCommand, progress: Callable[[int, int], None]) -> RankReply:
        if command.kind == "load":
            self.models[command.name] = self._load(command)
            return RankReply(kind="done")
        if command.kind == "drop":
            self.models.pop(command.name, None)
            return RankReply(kind="done")
        model = self.models[command.name]
        if command.kind == "train":
            return RankReply(kind="done", metrics=self._train(model, command, progress))
        if command.kind == "sft":
            return RankReply(kind="done", batches=self._sft(model, command, progress))
        if command.kind == "snapshot":
            model.snapshot = weights.snapshot(model.model, model.optimizer)
            return RankReply(kind="done")
        if command.kind == "restore":
            assert model.snapshot is not None, "restore without a snapshot"
            weights.restore(model.model, model.optimizer, model.snapshot)
            return RankReply(kind="done")
        return self._save(model, Path(command.directory or ""), command.optimizer)

    def _load(self, command: RankCommand) -> Sharded:
        from peft import get_peft_model, set_peft_model_state_dict
        from transformers import AutoConfig, AutoModelForCausalLM

        request = command.request
        assert request is not None
        saved = self.from_leader(lambda: _read_step(Path(command.checkpoint)) if command.checkpoint else None)
        source = resolve_base_model(request.base_model, self.settings)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.rank == 0:
            base = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        else:
            with torch.device("meta"):
                base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
        use_packed_attention(base)
        layers = set(getattr(base, "_no_split_modules", None) or ())
        config = lora_config(request.config) if saved is None else saved["config"]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(LORA_SEED)
            model = get_peft_model(base, config, adapter_name=ADAPTER)
        if self.rank == 0 and saved is not None:
            set_peft_model_state_dict(model, saved["adapter"], adapter_name=ADAPTER)
        full = model.state_dict() if self.rank == 0 else {}
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        for module in model.modules():  # the loss is already divided by the step's tokens: sum, not mean
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-scaled sum
        if self.rank == 0:
            model.to(self.device)  # its shards are there already; the buffers follow
        else:
            model.to_empty(device=self.device)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        for buffer in model.buffers():  # not in the state dict (rotary frequencies): rank 0 built them for real
            dist.broadcast(buffer, src=0)
        model.eval()
        optimizer = weights.make_optimizer(model)
        if saved is not None and saved["optimizer"] is not None:
            weights.load_optimizer(model, optimizer, saved["optimizer"])
        pad = self.from_leader(lambda: pad_id(_tokenizer(source)))
        return Sharded(
            model,
            optimizer,
            Policy(model, optimizer, pad, reduce=_summed, last=lambda last: model.set_requires_gradient_sync(last)),
        )

    def _train(self, sharded: Sharded, command: RankCommand, progress) -> dict[str, float]:
        sequences = [s.sequence() for s in command.sequences]
        mine = self._share(sequences, sharded.policy)
        total = sum(s.trained_tokens for s in sequences)
        assert command.config is not None
        return self.trainer.grpo_step(sharded.policy, mine, total, len(sequences), command.config, progress)

    def _sft(self, sharded: Sharded, command: RankCommand, progress) -> list[dict[str, float]]:
        shares = []
        for batch in command.batches:
            sequences = [s.sequence() for s in batch]
            shares.append(
                (self._share(sequences, sharded.policy), sum(s.trained_tokens for s in sequences), len(sequences))
            )
        return self.trainer.sft_steps(sharded.policy, shares, command.learning_rates, command.max_grad_norm, progress)

    def _share(self, sequences: list[Sequence], policy: Policy) -> list[list[Sequence]]:
        """This rank's micro-batches of the step: the sequences dealt out longest first to the rank with the fewest
        tokens (every rank computes the same deal), packed as one process packs them, then padded with idle
        micro-batches to the most any rank has (each backward pass is a collective every rank must join)."""
        loads, owners = [0] * self.world, {}
        for index in sorted(range(len(sequences)), key=lambda i: (-len(sequences[i].token_ids), i)):
            owner = loads.index(min(loads))
            owners[index] = owner
            loads[owner] += len(sequences[index].token_ids)
        packed = self.trainer.packs(policy.model)
        batches = [
            self.trainer.microbatches([s for i, s in enumerate(sequences) if owners[i] == rank], packed)
            for rank in range(self.world)
        ]
        most = max(1, *(len(b) for b in batches))
        idle = [Sequence([policy.pad_id] * 2, [False, False], [float("nan")] * 2)]  # no trained token: a zero loss
        return batches[self.rank] + [idle] * (most - len(batches[self.rank]))

    def _save(self, sharded: Sharded, directory: Path, with_optimizer: bool = True) -> RankReply:
        adapter = {name: _full(p).cpu() for name, p in sharded.model.named_parameters() if p.requires_grad}
        optimizer = weights.optimizer_state(sharded.model, sharded.optimizer) if with_optimizer else None
        if not self.leads:
            return RankReply(kind="done")
        try:
            sharded.model.save_pretrained(directory, selected_adapters=[ADAPTER], state_dict=adapter)
            if optimizer is not None:
                weights.save_optimizer(optimizer, directory)
        except OSError as exc:  # every rank's shards are as trained: the server restores the snapshot
            return RankReply(
                kind="error",
                intact=True,
                message=f"the trainer's leading rank could not write {directory}: {exc.strerror or exc}",
            )
        return RankReply(kind="done")

    def from_leader(self, read: Callable[[], Any]) -> Any:
        """What the leader reads (files on the head node), on every rank."""
        box = [read() if self.leads else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.control)
        return box[0]


def _read_step(step_dir: Path) -> dict[str, Any]:
    from peft import LoraConfig
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(step_dir))
    config.inference_mode = False  # saved adapters say inference; these train
    return {
        "config": config,
        "optimizer": weights.read_optimizer(step_dir),
        "adapter": load_file(str(step_dir / "adapter_model.safetensors")),
    }


def _tokenizer(source: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


@record
def main() -> None:
    settings = Settings()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=settings.trainer_rank_timeout))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    address = os.environ.get(LEADER_ENV)
    leads = address is not None and local_rank == 0
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, leads, group=control)
    if flags.count(True) != 1:
        raise RuntimeError(f"{flags.count(True)} ranks lead (the head node's torchrun alone sets {LEADER_ENV})")
    connection = _connect(address) if leads else None
    ranks = Ranks(settings, flags.index(True), control)

    def send(reply: RankReply) -> None:
        if connection is not None:
            connection.send_bytes(reply.model_dump_json().encode())

    while True:
        command = _next_command(connection, ranks)
        if command.kind == "stop":
            break
        try:
            reply = ranks.run(command, lambda done, total: send(RankReply(kind="progress", done=done, total=total)))
        except Exception as exc:
            send(RankReply(kind="error", message=_failure(ranks.rank, command.kind, exc)))
            raise  # torchrun restarts every rank; the server reloads the committed checkpoints (the log: the detail)
        send(reply)
    dist.destroy_process_group()


def _failure(rank: int, kind: str, exc: Exception) -> str:
    """A rank's failure in the cluster's words: a collective that lost its peers (gloo's or NCCL's text stays in
    the log) says that another rank or node stopped."""
    where = f"rank {rank} (on {socket.gethostname()})"
    text = str(exc)
    if isinstance(exc, dist.DistError) or any(sign in text for sign in _LOST_PEER):
        return (
            f"{where} lost its connection to the other ranks during {kind}: another rank stopped, or its node was lost"
        )
    return f"{where} failed during {kind}: {type(exc).__name__}: {text}"


def _connect(address: str | None) -> Connection:
    host, _, port = (address or "").rpartition(":")
    return Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_ENV]))


def _next_command(connection: Connection | None, ranks: Ranks) -> RankCommand:
    """The leader's next command from the server (a closed socket: the server stopped, so the ranks stop), on
    every rank."""

    def receive() -> str:
        assert connection is not None  # only the leader reads, and it holds the connection
        try:
            return connection.recv_bytes().decode()
        except (EOFError, OSError):
            return RankCommand(kind="stop").model_dump_json()

    return RankCommand.model_validate_json(ranks.from_leader(receive))


if __name__ == "__main__":
    main()
