"""End to end against real SGLang servers (needs a CUDA GPU and SGLang 0.5.23 installed beside mgrpo: no SGLang server
runs on CPU, so these are marked gpu and have not run in CI; the CPU tests are test_sglang_wire.py and
test_sglang_sync.py). Two guarded SGLang servers (`launch/rollout_server.py --engine sglang`, fp32); after a push of
new weights by SGLang's collective protocol (NCCL) both hold the version and their greedy and seeded T=0.7 logprobs
equal the trainer's own forward (<= 1e-4); a server killed mid-broadcast is excluded and rejoins; the tiny task
learns with --rollout.engine sglang."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from engine_helpers import diffs_after_push
from servers import ROOT, TOKEN, Server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"),
]
T = 0.7
RUN = "sglang-gpu-tests"


@pytest.fixture(scope="module")
def env(tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    base = tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2)
    logs = tmp_path_factory.mktemp("sglang_gpu")
    servers = [
        Server(
            base,
            free_port(),
            str(logs / f"sglang{i}.log"),
            timeout=1800,
            args=["--engine", "sglang", "--", "--dtype", "float32", "--mem-fraction-static", "0.3"],
        )
        for i in range(2)
    ]
    yield {
        "servers": servers,
        "base": base,
        "new": tiny_dirs("vllm_new", family="qwen2", vocab_size=300, num_layers=2, seed=99),
    }
    for s in servers:
        s.stop()


def connect(servers):
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.sglang import SGLangEngine

    return SGLangEngine(
        [s.url for s in servers], TOKEN, load_tokenizer(servers[0].model).eos_token_id, run_id=RUN, take_over=True
    )


def test_push_then_logprobs_equal_the_trainer_on_both_replicas(single_rank, env):
    from engine_helpers import trainer_actor

    from mgrpo.weights.transports.collective_sglang import SGLangCollectiveTransport

    engine = connect(env["servers"])
    transport = SGLangCollectiveTransport(engine, 1 << 20)
    receipt = transport.send_model(trainer_actor(env["new"]).models(), 1)
    assert len(receipt["servers"]) == 2
    for s in env["servers"]:
        worst = diffs_after_push(connect([s]), 1, env["new"], T)
        print(f"{s.url}: max |SGLang - trainer| logprob {worst}")
        assert max(worst.values()) <= 1e-4
    transport.close()


def test_the_tiny_task_learns_with_sglang(env, tmp_path):
    out = tmp_path / "run"
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "train_grpo.py"),
            "--config",
            os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
            "--model.path",
            env["base"],
            "--rollout.engine",
            "sglang",
            "--rollout.servers",
            ",".join(s.url for s in env["servers"]),
            "--rollout.remote.take_over",
            "true",
            "--train.steps",
            "12",
            "--logging.output_dir",
            str(out),
            "--logging.progress_bar",
            "false",
            "--logging.report",
            "false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(clean, MGRPO_SERVER_TOKEN=TOKEN),
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    first5, last5 = (sum(m["reward/mean"] for m in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last5 >= first5 + 0.2
