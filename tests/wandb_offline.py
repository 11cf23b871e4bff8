"""Read a wandb offline run's history back from its .wandb file (LevelDB-style log of protobuf Records), so
tests check what wandb itself stored, with no network and no wandb server."""

import glob
import json
import os
import struct
import time

BLOCK, HEADER = 32768, 7


def _records(path: str) -> list:
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path}: not a wandb datastore"
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer: zero padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        chunk, pos = data[pos : pos + length], pos + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    return out


def read_history(wandb_parent: str, deadline_s: float = 60.0) -> list:
    """[{key: value}] per logged step of the single offline run under wandb_parent/wandb/, once the file holds the
    run's exit record (wandb-core writes the file from its own process: wait for it, up to deadline_s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = glob.glob(os.path.join(wandb_parent, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under {wandb_parent}/wandb, found {runs}"
    end = time.monotonic() + deadline_s
    while True:
        rows, kinds = [], {}
        for raw in _records(runs[0]):
            rec = pb.Record()
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        if "exit" in kinds:
            return rows
        assert time.monotonic() < end, f"{runs[0]} has no exit record after {deadline_s} s; records: {kinds}"
        time.sleep(0.5)
