"""benchmarks/roofline.py's step bound against the same arithmetic written out by hand (float64), on a work whose
decode steps switch from compute-bound to memory-bound as the KV cache grows; and the Work read from a real model
folder (N from its matmul weights, K from its config)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import Machine, Work, bound, model_work  # noqa: E402


def test_the_bound_is_the_arithmetic_by_hand():
    m = Machine(gemm=1e11, bw=1e10)
    w = Work(
        params=10**7,
        weight_bytes=4 * 10**7,
        kv_bytes_per_token=10**5,
        seqs=4,
        prompt_tokens=40.0,
        completion_tokens=12.0,
    )
    got = bound(w, m)
    decode = 0.0
    for t in range(3):  # 12 completion tokens over 4 sequences: 3 decode steps, prompts of 10
        flops_s = 2 * 1e7 * 4 / 1e11
        bytes_s = (4e7 + 4 * (10 + t) * 1e5) / 1e10
        decode += max(flops_s, bytes_s)
    assert got["decode"] == pytest.approx(decode, rel=1e-12)
    assert got["train"] == pytest.approx(6 * 1e7 * 52 / 1e11, rel=1e-12)
    assert got["prefill"] == pytest.approx(2 * 1e7 * 40 / 1e11, rel=1e-12)
    assert got["step"] == pytest.approx(got["train"] + got["prefill"] + decode, rel=1e-12)
    assert bound(Work(10**7, 4 * 10**7, 0, 4, 40.0, 12.0), m)["decode"] < got["decode"]  # the KV term counts


def test_work_of_a_model_folder(tiny_dirs):
    model = tiny_dirs("roofline_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=0)
    w = model_work(model, seqs=8, prompt_tokens=80.0, completion_tokens=64.0)
    import json

    c = json.load(open(os.path.join(model, "config.json")))
    h, f, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    kv_heads = c["num_key_value_heads"]
    per_layer = h * c["num_attention_heads"] * d + 2 * h * kv_heads * d + c["num_attention_heads"] * d * h + 3 * h * f
    assert w.params == layers * per_layer + v * h  # lm_head counted, embeddings not (untied)
    assert w.kv_bytes_per_token == 2 * layers * kv_heads * d * 4 and w.weight_bytes == 4 * w.params
