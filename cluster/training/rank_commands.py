"""What the server says to the trainer's ranks and what they answer: pydantic messages, sent as JSON over one local
authenticated socket to the leading rank (cluster/training/rank_group.py -> cluster/training/sharded.py), which
shares each command with the other ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from art_sky.wire import RegisterRequest, TrainConfig

from .sequences import Sequence


class RankSequence(BaseModel):
    """A training sequence (cluster/training/sequences.py); NaN old logprobs travel as JSON's NaN."""

    model_config = ConfigDict(ser_json_inf_nan="constants")

    token_ids: list[int]
    trained: list[bool]
    old_logprobs: list[float]
    advantage: float

    @classmethod
    def of(cls, sequence: Sequence) -> RankSequence:
        return cls(
            token_ids=sequence.token_ids,
            trained=sequence.trained,
            old_logprobs=sequence.old_logprobs,
            advantage=sequence.advantage,
        )

    def sequence(self) -> Sequence:
        return Sequence(self.token_ids, self.trained, self.old_logprobs, self.advantage)


class RankCommand(BaseModel):
    """One command, run by every rank.

    load: build the model sharded over the ranks, from `checkpoint` (a step directory on the leader's node) or a
    fresh LoRA; train: one GRPO step on `sequences`; sft: one step per batch; snapshot / restore: a rollback point of
    each rank's own shards; save: the adapter and optimizer state into `directory` (the leader writes); drop: forget
    a model; stop: end the ranks."""

    model_config = ConfigDict(ser_json_inf_nan="constants")

    kind: Literal["load", "train", "sft", "snapshot", "restore", "save", "drop", "stop"]
    name: str = ""
    request: RegisterRequest | None = None
    checkpoint: str | None = None
    sequences: list[RankSequence] = []
    config: TrainConfig | None = None
    batches: list[list[RankSequence]] = []
    learning_rates: list[float] = []
    max_grad_norm: float = 1.0
    directory: str | None = None
    optimizer: bool = True  # save: the optimizer's state too (not for a step trained with save_checkpoint=False)


class RankReply(BaseModel):
    """The leader's answer: progress lines while a command runs, then `done` (with the step's metrics) or `error`
    (a rank failed: the ranks restart from the last committed checkpoint unless `rolled_back` says they are
    intact)."""

    kind: Literal["progress", "done", "error"]
    done: int = 0
    total: int = 0
    metrics: dict[str, float] = {}
    batches: list[dict[str, float]] = []
    message: str = ""
    intact: bool = False  # an error every rank saw before any shard changed: the ranks go on
