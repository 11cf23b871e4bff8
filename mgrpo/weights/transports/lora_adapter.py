"""`AdapterTransport`: LoRA adapter-only sync. The exported stream is the adapters' PEFT factors (a few MB where the
weights are GB); they are written as a PEFT folder (adapter_config.json + adapter_model.safetensors) in a private
temporary folder, and the engine serves the base with that folder as its LoRA from the next generation on."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterable

from mgrpo.weights.hf_writer import write_peft_folder
from mgrpo.weights.sync import StreamSync


class AdapterTransport(StreamSync):
    checksum = False  # a local folder, read by the engine on this machine

    def __init__(self, engine, adapter_config: dict):
        self.engine, self.config = engine, adapter_config
        self.dir = tempfile.mkdtemp(prefix="mgrpo-lora-")  # 0700: only this user's engine reads it
        self.current = None

    def send(self, named_tensors: Iterable[tuple], version: int) -> dict:
        """Write version `version`'s folder, have the engine load it, then delete the previous version's."""
        path = os.path.join(self.dir, f"v{version}")
        write_peft_folder(named_tensors, path, self.config, overwrite=True)
        nbytes = os.path.getsize(os.path.join(path, "adapter_model.safetensors"))
        receipt = self.engine.load_adapter(path, version)
        if self.current and self.current != path:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path
        return dict(receipt, bytes=nbytes, adapter_only=True)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
