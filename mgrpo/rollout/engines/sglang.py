"""`sglang` backend: the Engine protocol over HTTP to SGLang servers behind mgrpo's guard
(`launch/rollout_server.py --engine sglang`), each a replica with the whole model. The remote vLLM engine's client
(`engines/remote.py`: replicas, least-in-flight routing, timeouts, retries, exclusion and rejoin, run ownership)
with SGLang's dialect:

- request: `POST /generate {input_ids, sampling_params, return_logprob: true}` (token ids in, no chat template,
  no detokenisation needed: `skip_special_tokens` off, `no_stop_trim` on so the stop token stays in `output_ids`);
- response: `output_ids`, `meta_info.output_token_logprobs = [[logprob, token_id, text|null], ...]`,
  `meta_info.finish_reason = {"type": "stop"|"length"|"abort", ...}` and the weight version of each token from
  `meta_info.weight_versions` (spans `{version, start, end}`; a request that straddles an update carries several),
  else `meta_info.weight_version`.
- logprobs: SGLang returns `log_softmax(logits / T)` over the whole vocabulary (`layers/sampler.py`, before
  top-k/top-p), which is what mgrpo's trainer computes, unless the server runs with
  `SGLANG_RETURN_ORIGINAL_LOGPROB=1` (the guard refuses to start that way). Greedy (T=0): `log_softmax(logits)`.

Weights go by collective broadcast only (`transports/collective_sglang.py`: SGLang's `/init_weights_update_group`
and `/update_weights_from_distributed` with flattened buckets): SGLang has no route for mgrpo's HTTP buckets.
"""

from __future__ import annotations

from mgrpo.rollout.engine import register_engine
from mgrpo.rollout.engines.remote import (
    INTERRUPTED_HEADER,
    RemoteEngine,
    RemoteEngineError,
    engine_from_config,
    token_versions,
)
from mgrpo.rollout.types import GenerationResponse, SamplingParams

TOP_K_ALL = -1  # SGLang's "no top-k"
FINISH = {"stop": "stop", "length": "length"}


class SGLangEngine(RemoteEngine):
    name = "sglang"
    generate_path = "/generate"

    def request_body(self, req, sampling: SamplingParams) -> dict:
        params = {
            "max_new_tokens": req.max_tokens or sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or TOP_K_ALL,
            "ignore_eos": sampling.ignore_eos,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "sampling_seed": int(req.seed) & 0x7FFFFFFF,
        }
        if self.eos is not None and not sampling.ignore_eos:
            params["stop_token_ids"] = [self.eos]
        body = {
            "input_ids": list(req.prompt_ids),
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        return body  # no rid: a retry may land on the same server, where a repeated rid is refused

    def parse_response(self, data: dict, headers, server: str) -> GenerationResponse:
        out = parse_generate(data, server)
        if out.finish_reason == "abort" and headers.get(INTERRUPTED_HEADER) == "1":
            out.finish_reason = "interrupted"  # a checkpoint cut it short: the manager continues it from its tokens
        return out

    def weight_transport(self, bucket_bytes: int, **kwargs):
        raise RemoteEngineError(
            "rollout.engine: sglang takes weights by collective broadcast only; set "
            "rollout.remote.transport: collective"
        )


def parse_generate(data: dict, server: str = "") -> GenerationResponse:
    """One non-streamed `/generate` answer -> GenerationResponse (token ids, logprobs, finish, per-token versions)."""
    if isinstance(data, list):  # a batch of one
        if len(data) != 1:
            raise RemoteEngineError(f"SGLang server {server}: {len(data)} answers to one request")
        data = data[0]
    ids = [int(t) for t in data.get("output_ids") or []]
    meta = data.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    if len(triples) != len(ids):
        raise RemoteEngineError(
            f"SGLang server {server}: {len(ids)} tokens but {len(triples)} logprobs (send return_logprob: true)"
        )
    logprobs = []
    for i, (triple, tok) in enumerate(zip(triples, ids)):
        lp, tid = triple[0], triple[1]
        if int(tid) != tok:
            raise RemoteEngineError(f"SGLang server {server}: logprob {i} is for token {tid}, output_ids has {tok}")
        logprobs.append(float(lp))
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return GenerationResponse(
        ids, logprobs, FINISH.get(kind, "abort"), token_versions(meta, len(ids)), served_by=server
    )


@register_engine("sglang")
def _make_sglang(cfg, model_dir: str, tokenizer) -> SGLangEngine:
    return engine_from_config(SGLangEngine, cfg, tokenizer)
