"""The checkpoint layout: atomic steps, manifests that catch corruption, ART's retention, history written once."""

import json
import os

import pytest

from art_sky.checkpoints import CheckpointDir, CorruptCheckpointError, StepRecord, history_entry, steps_to_keep, verify
from art_sky.layout import STEP_RECORD


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
    history = [
        history_entry(1, "val", {"reward": 0.9}),
        history_entry(2, "val", {"reward": 0.2}),
        history_entry(3, "train", {"reward": 1.0}),
        {"step": 4, "val/reward": None},
    ]
    assert steps_to_keep([0, 1, 2, 3, 4], history, "val/reward", keep_last=1) == {4, 1}
    assert steps_to_keep([0, 1, 2, 3, 4], history, "val/reward", keep_last=2) == {3, 4, 1}
    assert steps_to_keep([0, 1, 2], [], "val/reward", keep_last=1) == {2}


def test_lines_written_twice_are_removed_and_the_first_of_each_kept(tmp_path):
    """What servers used to write at each start (a copy of the newest step's record line after the line the step
    wrote) and exact copies go; ART's own lines at a step, a step line missing its first write, and lines that
    cannot be read stay."""
    store = CheckpointDir(tmp_path, "proj", "m")
    records = {}
    for step in (1, 2, 3):
        records[step] = history_entry(step, "train", {"loss": 0.5 / step, "trained_tokens": 10.0 * step})

        def write(directory, step=step):
            write_adapter(b"x")(directory)
            (directory / STEP_RECORD).parent.mkdir()
            (directory / STEP_RECORD).write_text(
                StepRecord(step=step, kind="train", history=records[step]).model_dump_json()
            )

        store.save(step, write, base_model="b")

    published = {
        step: history_entry(
            step, "train", {"loss": 0.5 / step, "trained_tokens": 10.0 * step, "time/step_wall_s": 1.0}
        )  # as the step committed: timed
        for step in (1, 2)
    }

    val = history_entry(1, "val", {"reward": 0.5})
    art_line = history_entry(2, "train", {"loss": 0.25, "trained_tokens": 20.0})  # ART's model.log(metrics=...)
    lines = [
        published[1],
        records[1],
        val,
        published[2],
        records[2],
        records[1],
        art_line,
        records[2],
        val,
        records[3],
    ]  # step 3: killed before its timed line, then completed from the record
    (store.model_dir / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "{half\n")
    assert store.remove_duplicate_history() == 5
    kept = (store.model_dir / "history.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in kept[:-1]] == [published[1], val, published[2], art_line, records[3]]
    assert (store.model_dir / "history.jsonl").read_text().endswith("{half\n")
    assert all(store.has_step_line(StepRecord(step=step, kind="train", history=records[step])) for step in (1, 2, 3))
    assert store.remove_duplicate_history() == 0
