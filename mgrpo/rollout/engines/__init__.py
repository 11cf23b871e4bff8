"""Rollout engines, one file per backend behind the `Engine` protocol (`mgrpo.rollout.engine`), each registered
with `@register_engine(name)`: `hf` (transformers in the trainer's process), `vllm` (a colocated vLLM process),
`remote` (guarded vLLM servers over HTTP). A new backend is a new file here plus one import line in
`mgrpo.rollout.engine._builtins`; it reaches weights through a transport (`mgrpo.weights.transports`) and, if it
runs code inside the engine's own process, puts that code in `mgrpo.serving`.
"""
