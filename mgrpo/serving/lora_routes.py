"""The rollout server's LoRA route (behind the token guard): adapter-only weight sync for a LoRA trainer.

    PUT /mgrpo/lora/{version}   body: the version's adapter_model.safetensors (PEFT names); header
                                x-mgrpo-adapter-config: its adapter_config.json. Written to a folder in the staging
                                directory, checked (a safetensors header of lora_A/lora_B factors, a LORA config),
                                then loaded under the update gate as a new vLLM LoRA adapter named mgrpo-v{version}
                                (pause, add, reset the prefix cache, stamp the version, resume); the previous
                                adapter is dropped. Generation asks for it by that name (`model` in /v1/completions).

Needs the server started with LoRA on (`-- --enable-lora --max-lora-rank N`). The same ownership rules as the
weight routes apply (this run only, versions only forward). Nothing is unpickled: safetensors and JSON only.
"""
# (no `from __future__ import annotations`: FastAPI reads the route signatures at runtime)

import json
import os
import shutil

from mgrpo.serving.weight_routes import UpdateFailed, UpdateState, apply_version

CONFIG_HEADER = "x-mgrpo-adapter-config"


def adapter_name(version: int) -> str:
    return f"mgrpo-v{version}"


def check_adapter(path: str, config: dict) -> None:
    """A PEFT LoRA folder's two files, as far as can be told without loading them: raises ValueError naming what."""
    from safetensors import safe_open

    if config.get("peft_type") != "LORA" or not isinstance(config.get("r"), int):
        raise ValueError(f"{CONFIG_HEADER} is not a LoRA adapter_config (peft_type {config.get('peft_type')!r})")
    with safe_open(path, framework="pt") as f:  # reads the JSON header only
        names = list(f.keys())
    bad = [n for n in names if not n.endswith((".lora_A.weight", ".lora_B.weight"))]
    if not names or bad:
        raise ValueError(f"the adapter holds {len(names)} tensors, {len(bad)} not LoRA factors (e.g. {bad[:1]})")


def add_lora_routes(app, engine_client, gate, staging, update: UpdateState, update_timeout_s: float = 600.0) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

    current = {"name": None, "dir": None}

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    @app.put("/mgrpo/lora/{version}")
    async def put_adapter(version: int, request: Request):
        if engine_client.vllm_config.lora_config is None:
            return error(
                409,
                "this server runs without LoRA: start it with -- --enable-lora --max-lora-rank N "
                "(N >= the trainer's model.lora.rank)",
            )
        size = int(request.headers.get("content-length") or -1)
        if not 0 < size <= staging.max_bytes:
            return error(
                413 if size > 0 else 411,
                f"adapter body of {size} bytes; send Content-Length, at most {staging.max_bytes} (--max-bucket-mb)",
            )
        try:
            config = json.loads(request.headers.get(CONFIG_HEADER, ""))
        except ValueError:
            return error(400, f"header {CONFIG_HEADER} must hold the adapter_config.json")
        async with update.lock:
            refused = update.refusal(version) or update.claim(version, request.headers)
            if refused:
                return error(409, refused)
            folder = os.path.join(staging.dir, f"lora-v{version}")
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            got = 0
            try:
                with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
                    async for chunk in request.stream():
                        got += len(chunk)
                        if got > size:
                            break
                        f.write(chunk)
                if got != size:
                    raise ValueError(f"{got} bytes arrived, Content-Length {size}")
                with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                    json.dump(config, f)
                check_adapter(os.path.join(folder, "adapter_model.safetensors"), config)
            except Exception as exc:  # noqa: BLE001  (safetensors raises its own errors on a bad header)
                shutil.rmtree(folder, ignore_errors=True)
                return error(400, f"adapter of version {version} rejected, nothing loaded: {exc}")
            result = await apply_version(
                gate, update, engine_client, version, update_timeout_s, lambda timeout: _load(version, folder)
            )
            if not isinstance(result, dict):  # an error response; the previous adapter still serves
                shutil.rmtree(folder, ignore_errors=True)
                return result
            update.owner.committed(version)
            previous, current["name"], current["dir"] = dict(current), adapter_name(version), folder
            await _drop(previous)
            return dict(result, adapter=adapter_name(version), bytes=size)

    async def _load(version: int, folder: str) -> dict:
        models = app.state.openai_serving_models
        out = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=adapter_name(version), lora_path=folder))
        if not isinstance(out, str):  # vLLM's ErrorResponse
            raise UpdateFailed(f"vLLM refused the adapter of version {version}: {getattr(out, 'error', out)}")
        return {"adapter": adapter_name(version)}

    async def _drop(previous: dict) -> None:
        models = app.state.openai_serving_models
        name = previous.get("name")
        if name and name in models.lora_requests:
            lora_id = models.lora_requests[name].lora_int_id
            await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
            await engine_client.remove_lora(lora_id)
        if previous.get("dir"):
            shutil.rmtree(previous["dir"], ignore_errors=True)
