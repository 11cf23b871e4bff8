"""What runs inside an engine's own process: the guarded rollout server (`server`, vLLM's OpenAI app plus our
token guard and weight routes), the colocated engine process (`vllm_child`), the worker extension vLLM mixes into
its workers (`vllm_worker`), the settings both vLLM launchers share (`vllm_settings`), the receivers of weight
buckets and broadcasts, and the SGLang guard. It reads the weights wing's formats (`mgrpo.weights.bucket`,
`mgrpo.weights.local_rpc`); only the launchers (mgrpo/cli/serve.py) and the engine clients reach it, and the
trainer side starts `server` and `vllm_child` as processes rather than importing them.
"""
