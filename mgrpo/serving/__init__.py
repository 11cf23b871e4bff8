"""What runs inside an engine's own process: the guarded rollout server (`server`, vLLM's OpenAI app plus our
token guard and weight routes), the colocated engine process (`vllm_child`), the worker extension vLLM mixes into
its workers (`vllm_worker`), the settings both vLLM launchers share (`vllm_settings`) and the length-prefixed
JSON RPC over Unix sockets (`local_rpc`). The trainer side never imports `server` or `vllm_child`; it starts them
as processes.
"""
