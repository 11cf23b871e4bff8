"""SGLang's weight plane without a model, for the SGLang sync tests on CPU (no SGLang server runs here: its kernels
are CUDA-only). Run with `.sglang/` on PYTHONPATH. The data plane is SGLang 0.5.23's own code: each request body is
parsed with its io_struct class the way FastAPI does, groups are joined by SGLang's
`WeightUpdater.init_weights_update_group` (as TP worker 0) and buckets taken by its
`receive_weights_from_distributed`; only this small HTTP shim and the absence of a model are ours (with a
`generate-hold` file in the dump folder, /generate holds until a `generate-release` file appears or a pause of mode
`abort` comes, then answers one token, finish "length" or "abort": the drain and interrupt tests). What arrives is
kept and written to `--dump/v{version}.safetensors` at /update_weight_version; GET /standin/calls lists the
weight-route calls in order. Like SGLang with `--admin-api-key`, every route but /health wants that key.

    PYTHONPATH=.sglang python tests/rollout/sglang_standin.py --port P --dump DIR   (key in MGRPO_SGLANG_ADMIN_KEY)
"""

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_peer  # noqa: E402,F401  (stands in for the two torchvision-bound SGLang modules before any import)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dump", required=True, help="where each version's weights go (and a receive-delay file)")
    args = ap.parse_args()
    key = os.environ["MGRPO_SGLANG_ADMIN_KEY"]

    import pydantic
    import torch.distributed as dist
    from aiohttp import web
    from safetensors.torch import save_file
    from sglang.srt.managers import io_struct
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    updater = WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=None,
        update_model_fields=None,
        recapture_cuda_graph=None,
        get_model_runner=None,
    )
    weights, calls, lock, version, aborted = {}, [], asyncio.Lock(), ["0"], [0]
    delay = os.path.join(args.dump, "receive-delay")  # tests: seconds to wait before each bucket, if it exists
    parse = {
        "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
        "/update_weight_version": io_struct.UpdateWeightVersionReqInput,
        "/pause_generation": io_struct.PauseGenerationReqInput,
        "/continue_generation": io_struct.ContinueGenerationReqInput,
        "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
        "/end_weight_update": io_struct.EndWeightUpdateReqInput,
    }

    async def handle(request: web.Request) -> web.Response:
        path = request.path
        if path == "/health":
            return web.Response(text="ok")
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if path == "/get_server_info":
            return web.json_response({"tp_size": 1, "pp_size": 1, "weight_version": "0"})
        if path == "/model_info":
            return web.json_response({"weight_version": version[0]})
        if path == "/standin/calls":
            return web.json_response(calls)
        if path == "/generate":  # no model: with a `generate-hold` file, holds until `generate-release` (60 s at most)
            if not os.path.exists(os.path.join(args.dump, "generate-hold")):
                return web.json_response({"error": "stand-in: no model"}, status=501)
            calls.append("/generate")
            aborts = aborted[0]
            for _ in range(1200):
                if os.path.exists(os.path.join(args.dump, "generate-release")) or aborted[0] != aborts:
                    break
                await asyncio.sleep(0.05)
            calls.append("/generate done")
            finish = {"type": "abort" if aborted[0] != aborts else "length"}
            info = {"finish_reason": finish, "output_token_logprobs": [[-1.0, 7, None]]}
            return web.json_response({"output_ids": [7], "meta_info": dict(info, weight_version=version[0])})
        body = await request.json() if request.can_read_body else {}
        async with lock:  # SGLang serves weight requests one at a time
            calls.append(path)
            try:
                obj = pydantic.TypeAdapter(parse[path]).validate_python(body) if path in parse else None
                if path == "/init_weights_update_group":
                    ok, msg = await asyncio.to_thread(
                        updater.init_weights_update_group,
                        obj.master_address,
                        obj.master_port,
                        obj.rank_offset,
                        obj.world_size,
                        obj.group_name,
                        obj.backend,
                    )
                    return web.json_response({"success": ok, "message": msg}, status=200 if ok else 400)
                if path == "/pause_generation" and obj.mode == "abort":
                    aborted[0] += 1  # SGLang ends the requests in flight with what they have
                if path == "/update_weights_from_distributed":
                    if os.path.exists(delay):
                        await asyncio.sleep(float(open(delay).read() or 0))
                    got = await asyncio.to_thread(
                        updater.receive_weights_from_distributed,
                        names=obj.names,
                        dtypes=obj.dtypes,
                        shapes=obj.shapes,
                        group_name=obj.group_name,
                        load_format=obj.load_format,
                    )
                    weights.update({n: t.clone() for n, t in got})
                elif path == "/update_weight_version":
                    save_file(dict(weights), os.path.join(args.dump, f"v{obj.new_version}.safetensors"))
                    weights.clear()
                    version[0] = obj.new_version
                return web.json_response({"success": True, "message": "ok"})
            except Exception as exc:  # noqa: BLE001
                return web.json_response({"success": False, "message": f"{type(exc).__name__}: {exc}"}, status=400)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=args.port, print=lambda *_: print("standin ready", flush=True))


if __name__ == "__main__":
    main()
