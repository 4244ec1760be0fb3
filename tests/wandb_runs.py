"""Reading back what W&B wrote in its offline mode (WANDB_MODE=offline): the rows of a run's .wandb file."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows `run.log` wrote to an offline run's .wandb file: W&B's record log (LevelDB's log format, 32 KiB blocks
    after a 7-byte header) of wandb_internal.proto Records, parsed with wandb's own protobuf classes."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"  # ident, then a 2-byte magic and the format version
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or the last part of a record
            records.append(pending)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows
