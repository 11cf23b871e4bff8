"""CPU default engine: HF transformers forward passes with our own batched sampling loop.

Our own loop, not `model.generate()`, so the distribution sampled from is exactly mgrpo's rollout settings
(temperature, top-k, top-p) and nothing from the model folder's `generation_config.json`, and each request draws
from its own generator (its seed), so a sample does not depend on what it was batched with. All requests go
through in batches of up to `rollout.max_num_seqs` rows, left-padded, with position ids counted from each row's
first real token and padding masked out of attention, so padding changes no logprob.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from mgrpo.models.routing import encode_routing
from mgrpo.parallel.cpu_shims import without_shims
from mgrpo.parallel.device import device
from mgrpo.rollout.engine import Capabilities, register_engine
from mgrpo.rollout.types import GenerationResponse, SamplingParams
from mgrpo.weights.bucket import ManifestCheck, dtype_name
from mgrpo.weights.transports.in_process import InProcessTransport


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log of the distribution sampled from: softmax(logits / T) restricted to the top-k tokens and to the
    smallest set whose probability reaches top_p, renormalised (-inf outside). vLLM's `processed_logprobs`.
    Temperature 0 (greedy) reports the T = 1 distribution."""
    x = logits.float() / (temperature if temperature > 0 else 1.0)
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # tokens after the set already reached top_p (the first stays)
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(x, -1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row: the first whose cumulative probability exceeds the row's uniform `u` in [0, 1) (scaled to
    the row's total, so rounding never runs past the end). A token of probability 0 is never the first past `u`:
    the token before it reaches the same sum. One vectorised draw for the batch instead of a multinomial per row."""
    cdf = probs.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_max(probs.shape[-1] - 1)


GQA_SDPA = "mgrpo_sdpa_gqa"


def sdpa_without_repeated_kv(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw
):
    """HF's sdpa attention (transformers/integrations/sdpa_attention.py), less its copy of the KV heads: HF repeats
    each KV head for its query heads whenever a mask is given (its CUDA kernels would fall back to math with
    `enable_gqa` and a mask), and the engine's left padding always gives one. torch's CPU kernel groups the heads
    itself (`enable_gqa`): the same output, without copying the whole cache every decode step."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=query.shape[2] > 1 and attention_mask is None and causal,
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model) -> bool:
    """On CPU, a model on HF's sdpa attention switches to `sdpa_without_repeated_kv` (with sdpa's masks)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not getattr(
        model, "_supports_attention_backend", False
    ):
        return False  # eager/flash, or a model class that takes no registered attention: HF's own stays
    AttentionInterface.register(GQA_SDPA, sdpa_without_repeated_kv)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)
    return True


def reserved_cache(capacity: int):
    """An HF `Cache` whose layers write each step's keys and values into buffers of `capacity` positions, allocated
    once, and hand attention a view of the filled part. HF's `DynamicLayer` concatenates the whole cache with the new
    token at every decode step (O(length) copies a step, O(length^2) a response); `StaticLayer` avoids that but
    attends over all `capacity` positions. Same keys, values and masks as `DynamicLayer` (vLLM's paged KV cache
    likewise never moves a written block)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class ReservedLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, dk = key_states.shape
            self._k = torch.empty(b, h, capacity, dk, dtype=self.dtype, device=self.device)
            self._v = torch.empty(b, h, capacity, value_states.shape[-1], dtype=self.dtype, device=self.device)
            self.length, self.is_initialized = 0, True
            self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]

        def update(self, key_states, value_states, *args, **kwargs) -> tuple:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > capacity:
                raise RuntimeError(f"KV cache of {capacity} positions is full ({end} asked): a bug in the engine")
            self._k[:, :, self.length : end] = key_states
            self._v[:, :, self.length : end] = value_states
            self.length = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

        def reorder_cache(self, beam_idx) -> None:  # the prompt's rows to each of its n requests
            if self.is_initialized:
                self._k, self._v = self._k.index_select(0, beam_idx), self._v.index_select(0, beam_idx)
                self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    return Cache(layer_class_to_replicate=ReservedLayer)


def request_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) % (1 << 63))
    return g


class HFEngine:
    capabilities = Capabilities(async_generate=False, sleep=False, logprobs="processed")
    name = "hf"

    def __init__(
        self,
        model_dir: str,
        eos_token_id: int,
        pad_token_id: int,
        dtype=torch.float32,
        max_num_seqs: int = 256,
        device="cpu",
        model=None,
    ):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)  # the trainer rank's device: the engine computes beside it
        if model is None:  # `model`: an HF model already built (e.g. from a config, for a sync benchmark)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(self.device).eval()
        if self.device.type == "cpu":
            use_gqa_sdpa(self.model)
        self.eos, self.pad, self.max_num_seqs = eos_token_id, pad_token_id, max_num_seqs
        self.version = 0
        self.requests_peak, self.requests_served = 0, 0  # rows of one forward batch: requests in flight
        self._prefill_rows = 0  # rows of the first forward of the batch in flight (its distinct prompts)
        # every layer full attention: the reserved KV cache (sliding or linear layers keep HF's own cache classes)
        kinds = set(getattr(self.model.config, "layer_types", None) or ["full_attention"])
        self._full_attention = kinds == {"full_attention"}
        from mgrpo.models.qwen3_moe import per_expert_views

        # a tied lm_head is not listed separately; fused MoE experts are addressed one expert at a time
        self._params = per_expert_views(dict(self.model.named_parameters()))
        self._expected = {n: (tuple(p.shape), dtype_name(p.dtype)) for n, p in self._params.items()}
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self._optional = ("lm_head.weight",) if tied and "lm_head.weight" not in self._params else ()
        # an update waits for generation in flight and new generation waits for an update (a background producer
        # may generate while the trainer pushes weights): no response mixes versions
        self._gate, self._inflight, self._updating = threading.Condition(), 0, False
        self._one_at_a_time = threading.Lock()  # two threads' forwards would mix their MoE routing records
        # MoE routers in layer order: each forward records the experts every input token went to
        self._routers = [m for n, m in self.model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]

    @torch.no_grad()
    def _generate_batch(self, requests: list, sp: SamplingParams) -> list:
        calls = []  # MoE: per model call, [batch, tokens, moe_layers, topk] of the experts each token went to
        layer_picks = []

        def picked(module, args, out):  # HF's router returns (logits, weights, indices [batch x tokens, topk])
            rows = len(requests) if calls else self._prefill_rows  # the first call runs each prompt once
            layer_picks.append(out[2].view(rows, -1, out[2].shape[-1]).cpu())
            if len(layer_picks) == len(self._routers):
                calls.append(torch.stack(layer_picks, 2))
                layer_picks.clear()

        hooks = [r.register_forward_hook(picked) for r in self._routers]
        limits = [r.max_tokens or sp.max_tokens for r in requests]  # each request's own (a data row's max_tokens)
        try:
            rows, lps, prompt_row = self._sample(requests, replace(sp, max_tokens=max(limits)))
        finally:
            for h in hooks:
                h.remove()
        out_ = []
        for i, (r, row, lp) in enumerate(zip(requests, rows, lps)):
            row, lp = row[: limits[i]], lp[: limits[i]]
            stop = (not sp.ignore_eos) and self.eos in row
            end = row.index(self.eos) + 1 if stop else len(row)
            routed = None
            if calls:  # the prompt's tokens (left-padded in the first call), then each fed response token
                first = calls[0][prompt_row[i], calls[0].shape[1] - len(r.prompt_ids) :]
                routed = encode_routing(torch.cat([first, *[c[i] for c in calls[1:end]]]).numpy())
            out_.append(
                GenerationResponse(
                    row[:end], lp[:end], "stop" if stop else "length", [self.version] * end, routed_experts=routed
                )
            )
        return out_

    def _sample(self, requests: list, sp: SamplingParams) -> tuple:
        """Token ids and logprobs of each row, every row up to the longest (one forward per new token), and the
        row of each request's prompt in the first forward.

        A prompt asked for n times (GRPO's group) is prefilled once and its KV cache copied to its n rows, as
        vLLM's prefix cache would (1/n of the prefill's FLOPs); only the last position's logits are computed."""
        b = len(requests)
        self.requests_peak, self.requests_served = max(self.requests_peak, b), self.requests_served + b
        unique, prompt_row = {}, []
        for r in requests:
            prompt_row.append(unique.setdefault(tuple(r.prompt_ids), len(unique)))
        prompts, longest = list(unique), max(len(p) for p in unique)
        self._prefill_rows = len(prompts)
        ids = torch.full((len(prompts), longest), self.pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), longest, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's next token lands in the last column
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=reserved_cache(longest + sp.max_tokens) if self._full_attention else None,
            use_cache=True,
            logits_to_keep=1,
        )
        rows = torch.tensor(prompt_row, device=self.device)
        cache, logits, mask, pos = out.past_key_values, out.logits[:, -1], mask[rows], pos[rows]
        if len(prompts) < b:
            cache.reorder_cache(rows)  # each request's row of its prompt's keys and values
            logits = logits[rows]
        # each row's uniforms from its own generator, drawn once (a prefix of the same stream whatever the length)
        draws = torch.stack([torch.rand(sp.max_tokens, generator=request_generator(r.seed)) for r in requests])
        done = torch.zeros(b, dtype=torch.bool)
        tokens, logps = [], []
        for step in range(sp.max_tokens):
            dist = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
            if sp.temperature == 0:
                nxt = dist.argmax(-1).cpu()
            else:
                nxt = inverse_cdf(dist.float().exp().cpu(), draws[:, step])
            nxt = nxt.masked_fill(done, self.pad).to(self.device)  # finished rows: padding
            tokens.append(nxt)
            logps.append(dist.gather(-1, nxt[:, None])[:, 0])
            if not sp.ignore_eos:
                done |= (nxt == self.eos).cpu()
                if bool(done.all()):
                    break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long, device=self.device)], 1)
            pos = pos[:, -1:] + 1
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1]
        return torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist(), prompt_row

    def generate_sync(self, requests: list, sampling: SamplingParams) -> list:
        with self._gate:
            self._gate.wait_for(lambda: not self._updating)
            self._inflight += 1
        try:
            out = []
            with self._one_at_a_time, without_shims():  # HF's model: no megatron CPU shim on each op
                for start in range(0, len(requests), self.max_num_seqs):
                    out += self._generate_batch(requests[start : start + self.max_num_seqs], sampling)
            return out
        finally:
            with self._gate:
                self._inflight -= 1
                self._gate.notify_all()

    async def generate(self, requests: list, sampling: SamplingParams) -> list:
        """Runs inline: the engine computes in this process and never waits on I/O, so there is nothing for a
        timeout to catch, and a worker thread would cost 2x here (two OpenMP thread teams on the same cores)."""
        return self.generate_sync(requests, sampling)

    @torch.no_grad()
    def update_weights(self, buckets, version: int) -> dict:
        """All or nothing: every bucket is checked (digest where it has one, and the manifest against this
        model: nothing unknown, nothing twice, right shapes and dtypes, nothing left out) before one tensor is
        copied, so a broken update leaves the served weights and version as they were. Waits for generation in
        flight to finish; generation asked for meanwhile waits for the update."""
        with self._gate:
            self._updating = True
            self._gate.wait_for(lambda: self._inflight == 0)
        try:
            return self._update(buckets, version)
        finally:
            with self._gate:
                self._updating = False
                self._gate.notify_all()

    def _update(self, buckets, version: int) -> dict:
        check = ManifestCheck(self._expected, optional=self._optional, receiver=f"engine {self.name}")
        staged = []
        for bucket in buckets:
            bucket.verify()
            check.add(bucket)
            staged.append(bucket)
        receipt = check.finish()
        for bucket in staged:
            for name, tensor in bucket.tensors():
                if name in self._params:
                    self._params[name].copy_(tensor)
        self.version = version
        return dict(receipt, version=version)

    def weight_transport(self, bucket_bytes: int):
        return InProcessTransport(self, bucket_bytes)

    @torch.no_grad()
    def score(self, prompt: list, response: list, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced logprobs of `response` after `prompt` (used to check weight sync)."""
        ids = torch.tensor([prompt + response], device=self.device)
        logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]

    def health(self) -> dict:
        return {"ok": True, "engine": self.name, "version": self.version, "time": time.time()}

    def stats(self, reset: bool = False) -> dict:
        """Requests in flight (this engine computes inline: 0 between calls), the peak batch, served."""
        out = {"requests_inflight": 0, "requests_peak": self.requests_peak, "requests_served": self.requests_served}
        if reset:
            self.requests_peak = 0
        return out


@register_engine("hf")
def _make_hf(cfg, model_dir: str, tokenizer) -> HFEngine:
    """The engine computes in the trainer's dtype (model.params_dtype), so weights arrive without a cast."""
    return HFEngine(
        model_dir,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=getattr(torch, cfg.model.params_dtype),
        max_num_seqs=cfg.rollout.max_num_seqs,
        device=device(),
    )
