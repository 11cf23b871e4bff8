"""Weight transports, one class per transport, all behind `mgrpo.weights.sync.WeightSync.push(export, version)`:

- `in_process.InProcessTransport`: the HF engine in the trainer rank that receives the export (views, no copy);
- `shared_memory.SharedMemoryTransport`: a colocated engine's worker maps buffers the trainer writes
  (`buffers`: POSIX shared memory on CPU, CUDA IPC on GPU);
- `http_buckets.HttpBucketTransport`: remote servers, bucket bodies streamed over HTTP;
- `lora_adapter.AdapterTransport`: LoRA adapter-only sync, the adapters as a PEFT folder the engine loads;
  (these four are `StreamSync`: fed by the exported stream)
- `collective.CollectiveTransport`, `collective_sglang.SGLangCollectiveTransport`: each pipeline stage broadcasts
  its own weights to the servers' workers (`PerStageSync`).

Transports pack buckets in the format `mgrpo.weights.bucket` defines (and documents); they depend on that
module, on `mgrpo.weights.sync` and on the engine-process RPC framing (`mgrpo.weights.local_rpc`), never on an
engine's or a server's internals (mgrpo/serving/ imports them, not the other way).
"""
