"""Weight transports: how exported HF tensors reach an engine, one class per transport, each with
`send(named_tensors, version) -> receipt` (`base.Transport`):

- `in_process.InProcessTransport`: the HF engine in the trainer rank that receives the export (views, no copy);
- `shared_memory.SharedMemoryTransport`: a colocated engine's worker maps buffers the trainer writes
  (`buffers`: POSIX shared memory on CPU, CUDA IPC on GPU);
- `http_buckets.HttpBucketTransport`: remote servers, bucket bodies streamed over HTTP;
- `lora_adapter.AdapterTransport`: LoRA adapter-only sync, the adapters as a PEFT folder the engine loads.

Transports pack buckets in the format `mgrpo.resharding.bucket` defines (and documents); they depend on that
module, on `base` and on the engine-process RPC framing (`mgrpo.rollout.serving.local_rpc`), never on an engine's
or a server's internals.
"""
