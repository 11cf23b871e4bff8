"""The SGLang engine's wire against SGLang 0.5.23's own code (no SGLang server runs on this CPU: its kernels are
CUDA-only; see the README's SGLang section). SGLang's side runs in a subprocess (`sglang_peer.py`) with `.sglang/`
(installed by scripts/setup.sh) on its path:

- every request body mgrpo sends (generation and the whole weight-update sequence) passes SGLang's own parsers and
  declares no field SGLang would silently ignore; bodies with a wrong field or value are refused (negative controls);
- `/generate` answers assembled from SGLang's own pieces parse into the right tokens, logprobs, finish reasons and
  per-token weight versions (a request that straddles an update included);
- flattened buckets broadcast by mgrpo's sender (rank 0, hosting the store) arrive bit-exact through SGLang's own
  `init_custom_process_group` and `WeightUpdater.receive_weights_from_distributed`, at two receiving workers (a TP2
  server: rank offset 1), over gloo.
"""

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

from mgrpo.rollout.engines.remote import RemoteEngineError
from mgrpo.rollout.engines.sglang import SGLangEngine, parse_generate
from mgrpo.rollout.types import GenerationRequest, SamplingParams
from mgrpo.weights.stream_pack import StreamPacker
from mgrpo.weights.transports.collective_sglang import (
    BEGIN,
    END,
    FLUSH,
    PAUSE,
    RESUME,
    bucket_body,
    init_group_body,
    version_body,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER = os.path.join(ROOT, "tests", "rollout", "sglang_peer.py")
SGLANG = os.path.join(ROOT, ".sglang")


def pack_flattened(items: list) -> tuple:
    """(flat, {names, dtypes, shapes}) of items that make one bucket in SGLang's layout, as the senders pack it."""
    packer = StreamPacker([None, None], 1 << 30, "flattened")
    for name, t in items:
        assert packer.fits(t), f"{name} would start a new bucket"
        packer.add(name, t)
    return packer.take()


def peer(*args, timeout=240) -> subprocess.CompletedProcess:
    if not os.path.isdir(os.path.join(SGLANG, "sglang")):
        pytest.fail(f"{SGLANG} is missing: run bash scripts/setup.sh (it installs SGLang's package there)")
    env = dict(os.environ, PYTHONPATH=SGLANG, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, PEER, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


def run_json(mode: str, payload, tmp_path):
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(payload))
    r = peer(mode, path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _engine(eos=2):
    engine = SGLangEngine.__new__(SGLangEngine)  # the dialect alone: no servers to reach
    engine.eos = eos
    return engine


def test_request_bodies_pass_sglangs_own_parsers(tmp_path):
    e = _engine()
    req = GenerationRequest([5, 6, 7], seed=2**62 + 12345)
    gen = [
        e.request_body(req, SamplingParams(temperature=0.0, max_tokens=16)),
        e.request_body(req, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=8)),
        e.request_body(req, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)),
        _engine(None).request_body(req, SamplingParams()),
    ]
    meta = pack_flattened([("b", torch.zeros(2, 2)), ("a", torch.zeros(3, dtype=torch.bfloat16))])[1]
    control = [
        init_group_body("127.0.0.1", 29500, 2, "mgrpo-abc-stage0", "gloo"),
        PAUSE,
        BEGIN,
        ("/update_weights_from_distributed", bucket_body(meta, "mgrpo-abc-stage1")),
        END,
        FLUSH,
        ("/update_weight_version", version_body(7)),
        RESUME,
    ]
    control = [("/init_weights_update_group", control[0])] + control[1:]
    bad_sampling = dict(gen[1], sampling_params=dict(gen[1]["sampling_params"], max_tokens=8))  # vLLM's name
    bad_value = dict(gen[1], sampling_params=dict(gen[1]["sampling_params"], temperature=-1.0))
    bad_control = ("/update_weight_version", {"version": "7", "abort_all_requests": False})  # not new_version
    items = (
        [{"route": "/generate", "body": b} for b in gen]
        + [{"route": r, "body": b} for r, b in control]
        + [
            {"route": "/generate", "body": bad_sampling},
            {"route": "/generate", "body": bad_value},
            {"route": bad_control[0], "body": bad_control[1]},
        ]
    )
    out = run_json("check", items, tmp_path)
    print(json.dumps(out, indent=1))
    good, bad = out[: len(gen) + len(control)], out[len(gen) + len(control) :]
    assert all(x["ok"] for x in good), [x for x in good if not x["ok"]]
    assert [x["ok"] for x in bad] == [False, False, False]  # negative controls: SGLang's parsers refuse them
    assert "max_tokens" in bad[0]["error"] and "UpdateWeightVersionReqInput" in bad[2]["error"]


def test_answers_built_by_sglang_parse_into_tokens_logprobs_and_versions(tmp_path):
    gens = [
        {"output_ids": [11, 12, 2], "logprobs": [-0.5, -1.25, -0.125], "finish": "stop", "versions": "4"},
        {
            "output_ids": [9, 9, 9, 9],
            "logprobs": [-2.0, -0.0, -3.5, -1.0],
            "finish": "length",
            "versions": "4",
            "events": [["3", 2]],
        },  # tokens 0-1 from version 3, 2-3 from version 4
        {"output_ids": [], "logprobs": [], "finish": "abort", "versions": "5"},
    ]
    answers = run_json("answer", gens, tmp_path)
    got = [parse_generate(a, "s1") for a in answers]
    assert [g.token_ids for g in got] == [[11, 12, 2], [9, 9, 9, 9], []]
    assert got[0].logprobs == [-0.5, -1.25, -0.125] and got[1].logprobs == [-2.0, -0.0, -3.5, -1.0]
    assert [g.finish_reason for g in got] == ["stop", "length", "abort"]
    assert got[0].weight_versions == [4, 4, 4] and got[1].weight_versions == [3, 3, 4, 4]
    broken = dict(answers[0], meta_info=dict(answers[0]["meta_info"], output_token_logprobs=[[-0.5, 11, None]]))
    with pytest.raises(RemoteEngineError, match="3 tokens but 1 logprobs"):
        parse_generate(broken, "s1")


def test_the_guards_sglang_command_line_parses_with_sglangs_own_cli(tmp_path):
    from mgrpo.serving.sglang_guard import sglang_command

    cmd = sglang_command("/models/qwen", 30123, "k" * 43, ["--dtype", "float32"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    got = run_json("argv", cmd[3:], tmp_path)
    assert got == {
        "model_path": "/models/qwen",
        "host": "127.0.0.1",
        "port": 30123,
        "api_key": "k" * 43,
        "admin_api_key": "k" * 43,
        "skip_tokenizer_init": True,
        "weight_version": "0",
        "dtype": "float32",
    }


def _tensors():
    g = torch.Generator().manual_seed(3)
    return [
        [
            ("counts", torch.randint(0, 9, (3,), generator=g, dtype=torch.int64)),
            ("model.norm.weight", torch.randn(7, generator=g)),
            ("model.embed_tokens.weight", torch.randn(33, 16, generator=g).to(torch.bfloat16)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(5, 3, generator=g).half()),
        ],
        [("lm_head.weight", torch.randn(64, 16, generator=g))],
    ]


def _sender(group_name: str, workers: int, q) -> None:
    from mgrpo.weights.transports.collective_sglang import SenderGroup

    group = SenderGroup("127.0.0.1", group_name, "gloo", timeout_s=60)
    q.put(
        (
            init_group_body("127.0.0.1", group.port, workers, group_name, "gloo"),
            [bucket_body(pack_flattened(items)[1], group_name) for items in _tensors()],
        )
    )
    group.join(1 + workers)
    for items in _tensors():
        flat, _ = pack_flattened(items)
        group.broadcast(flat).wait()
    q.put("sent")
    group.close()


def test_flattened_buckets_reach_sglangs_own_receiver_bit_exact(tmp_path):
    from safetensors.torch import load_file

    ctx = mp.get_context("spawn")
    q, name, workers = ctx.Queue(), "mgrpo-" + os.urandom(6).hex() + "-stage0", 2
    sender = ctx.Process(target=_sender, args=(name, workers, q))
    sender.start()
    init, bodies = q.get(timeout=60)
    (tmp_path / "init.json").write_text(json.dumps(init))
    (tmp_path / "buckets.json").write_text(json.dumps(bodies))
    env = dict(os.environ, PYTHONPATH=SGLANG, PYTHONWARNINGS="ignore")
    receivers = [
        subprocess.Popen(
            [
                sys.executable,
                PEER,
                "receive",
                str(tmp_path / "init.json"),
                str(w),
                str(tmp_path / "buckets.json"),
                str(tmp_path / f"got{w}.st"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(workers)
    ]
    outs = [p.communicate(timeout=240) for p in receivers]
    for p, (_, err) in zip(receivers, outs):
        assert p.returncode == 0, err[-3000:]
    assert q.get(timeout=60) == "sent"
    sender.join(timeout=30)
    want = {n: t for items in _tensors() for n, t in items}
    for w in range(workers):
        got = load_file(str(tmp_path / f"got{w}.st"))
        assert sorted(got) == sorted(want)
        for n, t in want.items():
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
