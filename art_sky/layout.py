"""Where files live, for both sides (the cluster server writes them, the laptop and the object store read them):

- A model's checkpoints under a checkpoint root (ART's `.art`): `<root>/<project>/models/<name>/checkpoints/
  <step:04d>/` (a PEFT LoRA, `training_state/` beside it: the optimizer's state and the step's record, and
  `manifest.json` over all of them), `history.jsonl` beside `checkpoints/`, and `lineage.lock` with `owner.json`:
  the one server writing the lineage, and who it is (art_sky.ownership). The object store uses the same relative
  keys under its prefix.
- A cluster server's run files in its run directory: `server.pid`, `port.json` (`{"port": N, "pid": P}` once it
  listens), `server.log` (the previous start's is `server.log.1`), and `server.lock`, which the server holds while it
  runs (a second server on the same run files is refused).
"""

from __future__ import annotations

import posixpath

from pydantic import BaseModel

MANIFEST = "manifest.json"
HISTORY = "history.jsonl"
ROLLOUTS = "rollouts.jsonl"  # beside it: each GRPO step's groups, rewards, advantages, skip reasons (the dashboard's)
TRAINING_STATE = "training_state"  # in a step: what an exact resume needs beyond the LoRA (vLLM loads the LoRA alone)
OPTIMIZER_STATE = f"{TRAINING_STATE}/optimizer.safetensors"
OPTIMIZER_STATE_PICKLED = f"{TRAINING_STATE}/optimizer.pt"  # torch.save's, in checkpoints written before
STEP_RECORD = f"{TRAINING_STATE}/step.json"
PID_FILE = "server.pid"
PORT_FILE = "port.json"
LOG_FILE = "server.log"
LOCK_FILE = "server.lock"
LINEAGE_LOCK = "lineage.lock"  # in a model's directory: held by the one server that writes the lineage
OWNER_FILE = "owner.json"  # beside it (and under the lineage's store prefix): who that server is


def step_name(step: int) -> str:
    return f"{step:04d}"


def model_key(project: str, name: str) -> str:
    """A model's directory relative to the checkpoint root (and its key prefix in the store)."""
    return f"{project}/models/{name}"


def step_key(project: str, name: str, step: int) -> str:
    return f"{model_key(project, name)}/checkpoints/{step_name(step)}"


class ServerLayout(BaseModel):
    """One cluster server's files on its machine: absolute POSIX paths there (the machine may be remote)."""

    run_dir: str  # server.pid, port.json, server.log: one server's own
    art_path: str  # the checkpoint root, which servers of one machine may share

    @classmethod
    def under(cls, root: str) -> ServerLayout:
        """The layout of a server directory on an SSH host or a SkyPilot cluster: `run/` and `art/` in `root`."""
        return cls(run_dir=posixpath.join(root, "run"), art_path=posixpath.join(root, "art"))

    @property
    def pid_file(self) -> str:
        return posixpath.join(self.run_dir, PID_FILE)

    @property
    def port_file(self) -> str:
        return posixpath.join(self.run_dir, PORT_FILE)

    @property
    def log_file(self) -> str:
        return posixpath.join(self.run_dir, LOG_FILE)
