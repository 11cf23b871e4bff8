"""SGLang 0.5.23's side of the SGLang wire tests, in its own process with `.sglang/` on sys.path (importing sglang
patches transformers, so never in pytest's own process). It judges with SGLang's own code only:

  check FILE     request bodies [{route, body}] -> [{route, ok, error}]: `/generate` through SGLang's JSON contract
                 gate (`api_contract.generate_contract_error`), FastAPI's parse of `GenerateReqInput`, then
                 `SamplingParams(**sampling_params).normalize/verify` as the TokenizerManager does; every other
                 route through pydantic's parse of its io_struct class, as FastAPI does. SGLang ignores unknown
                 fields silently, so a field the class does not declare is reported too.
  answer FILE    generations [{output_ids, logprobs, finish, versions}] -> `/generate` answers built with SGLang's
                 own pieces: finish reasons from `schedule_batch.FINISH_*`, the logprob triples from
                 `TokenizerManager.detokenize_logprob_tokens`, per-token versions from `compute_weight_version_spans`
                 + `add_weight_versions_to_meta_info`, serialised by `dumps_json` (the dict layout is
                 tokenizer_manager.py's, for BatchTokenIDOutput: output_ids + meta_info).
  argv FILE      the guard's SGLang command line through SGLang's own CLI parser.
  receive ...    a `WeightUpdater` (SGLang's, as worker `tp_rank`) joins the group with mgrpo's
                 /init_weights_update_group body (`init_weights_update_group`: rank = offset + TP rank, SGLang's
                 `init_custom_process_group`) and takes flattened buckets with `receive_weights_from_distributed`
                 from mgrpo's /update_weights_from_distributed bodies; writes what arrived as safetensors.

Two SGLang modules that import torchvision at import time (vision model configs, unused here) are replaced by empty
stand-ins: the PyPI torchvision does not load beside the CPU build of torch.
"""

import json
import sys
import types


class _Unavailable(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"model_type": f"unavailable-{self.__name__}.{name}"})


for _m in ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr"):
    sys.modules[_m] = _Unavailable(_m)


def check(path: str) -> list:
    import dataclasses
    import inspect

    import msgspec
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams

    classes = {
        "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
        "/destroy_weights_update_group": io_struct.DestroyWeightsUpdateGroupReqInput,
        "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
        "/end_weight_update": io_struct.EndWeightUpdateReqInput,
        "/update_weight_version": io_struct.UpdateWeightVersionReqInput,
        "/pause_generation": io_struct.PauseGenerationReqInput,
        "/continue_generation": io_struct.ContinueGenerationReqInput,
    }
    out = []
    for item in json.load(open(path)):
        route, body = item["route"], item["body"]
        try:
            if route == "/generate":
                error = generate_contract_error(body)
                if error:
                    raise ValueError(f"contract: {error}")
                known = {f.name for f in dataclasses.fields(io_struct.GenerateReqInput)}
                obj = pydantic.TypeAdapter(io_struct.GenerateReqInput).validate_python(body)
                accepted = set(inspect.signature(SamplingParams).parameters)
                extra = sorted(set(body.get("sampling_params", {})) - accepted)
                if extra:
                    raise ValueError(f"sampling_params fields SGLang does not know: {extra}")
                params = SamplingParams(**obj.sampling_params)
                params.normalize(None)
                params.verify(item.get("vocab_size", 32000))
            elif route == "/flush_cache":
                known = set()
            else:
                cls = classes[route]
                known = {f.name for f in msgspec.structs.fields(cls)}
                pydantic.TypeAdapter(cls).validate_python(body)
            extra = sorted(set(body) - known)
            if extra:
                raise ValueError(
                    f"fields {cls.__name__ if route in classes else route} does not declare "
                    f"(SGLang would ignore them): {extra}"
                )
            out.append({"route": route, "ok": True, "error": ""})
        except Exception as exc:  # noqa: BLE001
            out.append({"route": route, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]})
    return out


def answer(path: str) -> list:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.json_response import dumps_json
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    out = []
    for g in json.load(open(path)):
        ids = g["output_ids"]
        finish = {
            "stop": lambda: FINISH_MATCHED_TOKEN(ids[-1]),
            "length": lambda: FINISH_LENGTH(len(ids)),
            "abort": lambda: FINISH_ABORT("client aborted"),
        }[g["finish"]]().to_json()
        meta = {
            "id": "rid",
            "finish_reason": finish,
            "prompt_tokens": 3,
            "weight_version": g["versions"][-1],
            "num_retractions": 0,
        }
        meta["output_token_logprobs"] = TokenizerManager.detokenize_logprob_tokens(None, g["logprobs"], ids, False)
        meta["output_token_logprobs_length"] = len(ids)
        # a version change mid-request: SGLang records (old version, tokens made so far) at each update
        events = [WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in g.get("events", [])]
        add_weight_versions_to_meta_info(
            meta, compute_weight_version_spans(events, g["versions"][-1], len(ids)), len(ids)
        )
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0})
        out.append(json.loads(dumps_json({"output_ids": list(ids), "meta_info": meta})))
    return out


def argv(path: str) -> dict:
    """SGLang's own CLI parse (`prepare_server_args`, as `python -m sglang.launch_server` does) of the arguments the
    guard starts it with."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(json.load(open(path)))
    return {
        k: getattr(args, k)
        for k in (
            "model_path",
            "host",
            "port",
            "api_key",
            "admin_api_key",
            "skip_tokenizer_init",
            "weight_version",
            "dtype",
        )
    }


def receive(init_path: str, tp_rank: int, meta_path: str, out_path: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    # SGLang's scheduler has its own default group (its TP group) when it joins; here: a group of one
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    updater = WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=None,
        update_model_fields=None,
        recapture_cuda_graph=None,
        get_model_runner=None,
    )  # the group and receive paths use only these
    init = json.load(open(init_path))  # the body of mgrpo's /init_weights_update_group request
    ok, message = updater.init_weights_update_group(**init)
    if not ok:
        raise SystemExit(message)
    got = {}
    for m in json.load(open(meta_path)):  # what mgrpo's /update_weights_from_distributed requests carried
        body = json.loads(json.dumps(m))
        for name, tensor in updater.receive_weights_from_distributed(
            names=body["names"],
            dtypes=body["dtypes"],
            shapes=body["shapes"],
            group_name=body["group_name"],
            load_format=body["load_format"],
        ):
            got[name] = tensor.clone()
    save_file(got, out_path)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "receive":
        receive(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        print(json.dumps({"check": check, "answer": answer, "argv": argv}[mode](sys.argv[2]), default=str))
