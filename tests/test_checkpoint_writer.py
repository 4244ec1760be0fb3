"""Checkpoints written in the background (cluster/checkpoint_writer.py): the next step commits only once the previous
one is on disk, kill -9 during a write leaves whole steps only, an engine gets a pending step's adapter, and what is
staged is exactly what PEFT and the optimizer would have saved."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from art_sky.checkpoints import CheckpointDir, StepRecord, verify
from art_sky.cluster.checkpoint_writer import CheckpointWriter
from art_sky.cluster.model_state import ModelState, ensure_optimizer, load_peft
from art_sky.cluster.training import weights
from art_sky.settings import Settings
from art_sky.wire import RegisterRequest


class SlowStaged:
    """A step's state whose write waits until `go` is set (a slow disk)."""

    nbytes = 1024

    def __init__(self, step: int, go: threading.Event):
        self.step, self.go = step, go

    def write(self, directory: Path) -> None:
        assert self.go.wait(30)
        (directory / "adapter_model.safetensors").write_text(f"weights of step {self.step}")

    def write_adapter(self, directory: Path) -> None:
        (directory / "adapter_model.safetensors").write_text(f"served weights of step {self.step}")

    def release(self) -> None:
        pass


def test_the_next_step_commits_only_once_the_previous_step_is_on_disk(tmp_path):
    checkpoints = CheckpointDir(tmp_path, "p", "m")
    writer = CheckpointWriter(checkpoints, "base", background=True)
    ready = threading.Event()
    ready.set()
    writer.write_now(StepRecord(step=0, kind="init"), SlowStaged(0, ready))
    go = threading.Event()
    writer.commit(StepRecord(step=1, kind="train"), SlowStaged(1, go))  # returns while step 1 is written
    assert checkpoints.steps() == [0] and writer.record(1).step == 1
    served = writer.adapter_dir(1)  # an engine that loads files gets step 1's adapter now
    assert (served / "adapter_model.safetensors").read_text() == "served weights of step 1"
    on_disk_at_commit = []

    def next_step() -> None:
        writer.commit(StepRecord(step=2, kind="train"), SlowStaged(2, ready))
        on_disk_at_commit.append(checkpoints.steps())

    committing = threading.Thread(target=next_step)
    committing.start()
    committing.join(0.5)
    assert committing.is_alive() and checkpoints.steps() == [0]  # step 2 waits for step 1's write
    go.set()
    committing.join(10)
    assert on_disk_at_commit[0][:2] == [0, 1]
    assert writer.written(2) and checkpoints.steps() == [0, 1, 2]
    assert not served.exists() and writer.adapter_dir(1) == checkpoints.step_dir(1)


def test_kill_9_during_a_background_write_leaves_whole_steps_only(tmp_path):
    """A server killed while a step's files are being written: its directory was never renamed into place, so the
    disk lists step 0 alone, whole, and the next start removes what the write left."""
    script = tmp_path / "writer.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from art_sky.checkpoints import CheckpointDir, StepRecord
        from art_sky.cluster.checkpoint_writer import CheckpointWriter

        class Staged:
            nbytes = 1 << 20
            def __init__(self, slow): self.slow = slow
            def write(self, directory):
                with open(directory / "adapter_model.safetensors", "wb") as out:
                    out.write(b"x" * (1 << 20))
                    out.flush()
                    if self.slow:
                        os.write(1, b"writing\\n")  # one write: never interleaved with the other line
                        time.sleep(60)
            def write_adapter(self, directory): pass
            def release(self): pass

        writer = CheckpointWriter(CheckpointDir(Path({str(tmp_path)!r}), "p", "m"), "base", background=True)
        writer.write_now(StepRecord(step=0, kind="init"), Staged(False))
        writer.commit(StepRecord(step=1, kind="train"), Staged(True))
        os.write(1, b"committed\\n")
        time.sleep(60)
    """)
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [child.stdout.readline().strip(), child.stdout.readline().strip()]
        assert sorted(lines) == ["committed", "writing"], (lines, child.poll() is not None and child.stderr.read())
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    checkpoints = CheckpointDir(tmp_path, "p", "m")
    assert checkpoints.steps() == [0]
    verify(checkpoints.step_dir(0), checkpoints.manifest(0))
    assert not checkpoints.step_dir(1).exists()
    assert [p.name for p in checkpoints.remove_stale_temps()] and sorted(
        p.name for p in checkpoints.path.iterdir()
    ) == ["0000"]


def test_a_staged_step_is_what_peft_and_the_optimizer_save(tmp_path):
    """The adapter written from the host copy is PeftModel.save_pretrained's (tensors and config), and the optimizer's
    state comes back from its safetensors file as it was (AdamW's moments and step counts, its param groups)."""
    request = RegisterRequest(name="m", project="p", base_model="art-sky/tiny")
    model, tokenizer = load_peft(request, Settings(cache_dir=tmp_path / "cache"), None)
    state = ModelState(request, model, tokenizer, CheckpointDir(tmp_path, "p", "m"))
    optimizer = ensure_optimizer(state)
    model.train()
    model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path / "peft")
    staged = state.weights.stage()
    with torch.no_grad():  # the model trains on after staging: the staged copy does not move
        for param in weights.trainable(model):
            param.add_(1.0)
    staged.write(tmp_path / "staged")
    ours, peft = (
        load_file(tmp_path / "staged" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert ours.keys() == peft.keys() and all(torch.equal(ours[k], peft[k]) for k in ours)
    configs = [json.loads((tmp_path / where / "adapter_config.json").read_text()) for where in ("staged", "peft")]
    for config in configs:  # a set in PEFT: its order is the set's
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]
    saved, expected = weights.read_optimizer(tmp_path / "staged"), weights.optimizer_state(model, optimizer)  # moments
    # untouched by the add above
    assert saved["state"].keys() == expected["state"].keys()
    for name, entries in expected["state"].items():
        assert saved["state"][name].keys() == entries.keys()
        assert all(torch.equal(saved["state"][name][key], value) for key, value in entries.items())
    assert saved["param_groups"] == json.loads(json.dumps(expected["param_groups"]))  # betas: a list in JSON
    weights.load_optimizer(model, ensure_optimizer(state), saved)  # and it loads back
    written = sum(path.stat().st_size for path in (tmp_path / "staged").rglob("*") if path.is_file())
    assert staged.nbytes < written < staged.nbytes * 1.05 + (64 << 10)  # the room a step is checked for


def test_a_tensor_file_is_byte_for_byte_what_safetensors_writes(tmp_path):
    """The one-pass writer (cluster/training/tensor_file.py) against safetensors' own `save_file`: every dtype a
    checkpoint holds, a scalar (AdamW's step), an empty and a transposed tensor; the same bytes, and they load back."""
    from safetensors.torch import save_file

    from art_sky.cluster.training.tensor_file import save_tensors

    tensors = {
        "lora_B.weight": torch.randn(3, 5),
        "step": torch.tensor(3.0),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "f16": torch.randn(2, dtype=torch.float16),
        "index": torch.arange(5),
        "mask": torch.ones(3, dtype=torch.bool),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6).t(),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "theirs", metadata={"format": "pt"})
    save_tensors(tensors, tmp_path / "ours", metadata={"format": "pt"})
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes()
    loaded = load_file(tmp_path / "ours")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
