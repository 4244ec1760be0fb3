"""The checkpoint layout: atomic steps, manifests that catch corruption, ART's retention."""

import os

import pytest

from art_sky.checkpoints import CheckpointDir, CorruptCheckpointError, history_entry, steps_to_keep, verify


def write_adapter(payload: bytes):
    def write(directory):
        (directory / "adapter_model.safetensors").write_bytes(payload)
        (directory / "adapter_config.json").write_text('{"r": 8}')
    return write


def test_save_writes_layout_and_manifest(tmp_path):
    store = CheckpointDir(tmp_path, "proj", "m")
    manifest = store.save(3, write_adapter(b"x" * 1000), base_model="art-sky/tiny", metrics={"reward": 0.5})
    step_dir = tmp_path / "proj" / "models" / "m" / "checkpoints" / "0003"
    assert step_dir.is_dir() and (step_dir / "manifest.json").is_file()
    assert manifest.files["adapter_model.safetensors"].size == 1000
    assert store.steps() == [3]
    assert store.manifest(3).metrics == {"reward": 0.5}
    verify(step_dir, manifest)


def test_a_crash_mid_write_leaves_no_step(tmp_path):
    store = CheckpointDir(tmp_path, "proj", "m")

    def crash(directory):
        (directory / "adapter_model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.save(1, crash, base_model="b")
    assert store.steps() == []
    assert os.listdir(store.path) == []  # the temp dir is gone too


def test_flipped_byte_is_caught(tmp_path):
    store = CheckpointDir(tmp_path, "proj", "m")
    manifest = store.save(1, write_adapter(b"abcdef" * 100), base_model="b")
    path = store.step_dir(1) / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="adapter_model.safetensors"):
        verify(store.step_dir(1), manifest)


def test_retention_keeps_newest_and_best():
    history = [history_entry(1, "val", {"reward": 0.9}), history_entry(2, "val", {"reward": 0.2}),
               history_entry(3, "train", {"reward": 1.0}), {"step": 4, "val/reward": None}]
    assert steps_to_keep([0, 1, 2, 3, 4], history, "val/reward", keep_last=1) == {4, 1}
    assert steps_to_keep([0, 1, 2, 3, 4], history, "val/reward", keep_last=2) == {3, 4, 1}
    assert steps_to_keep([0, 1, 2], [], "val/reward", keep_last=1) == {2}
