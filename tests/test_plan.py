"""--print-plan: parameters summed over ranks equal HF's count for published shapes (meta device, fake process
group, one process), MoE ones at layouts with EP (experts owned per EP rank, once per expert-DP group); layouts
that do not divide give the launch's one-line errors; the 72B example plans for 16 ranks and stops with one line
when launched for real without a GPU; the Qwen3-30B-A3B example plans EP8 on 8 ranks."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN2 = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    vocab_size=152064,
    rope_theta=1e6,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SHAPES = {  # the published config.json fields that decide the parameter count
    "qwen2.5-7b": dict(
        QWEN2,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    ),
    "qwen2.5-72b": dict(
        QWEN2,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        rope_scaling=dict(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            rope_type="llama3",
        ),
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
    ),
}
QWEN3_MOE = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    vocab_size=151936,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    router_aux_loss_coef=0.001,
)
SHAPES.update(
    {
        "qwen3-30b-a3b": dict(
            QWEN3_MOE,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
        ),
        "qwen3-235b-a22b": dict(
            QWEN3_MOE,
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
        ),
    }
)
# (tp, pp) on tp x pp x 2 ranks (PP1) or tp x pp; MoE: (tp, pp, ep, world, sp), expert-DP = world / (tp x ep x pp)
EP_LAYOUTS = [(1, 1, 8, 8, False), (2, 1, 4, 8, True), (1, 2, 4, 8, False)]  # expert-DP 1
LAYOUTS = {
    "qwen2.5-7b": [(4, 2), (2, 1)],  # 28 heads: TP8 does not divide (tested below)
    "qwen2.5-72b": [(8, 2), (2, 1)],
    "llama-3.1-8b": [(8, 2), (2, 1)],
    "qwen3-8b": [(8, 2), (2, 1)],
    "qwen3-30b-a3b": EP_LAYOUTS + [(1, 1, 4, 16, False)],  # expert-DP 4: expert replicas count once
    "qwen3-235b-a22b": EP_LAYOUTS[:1],  # 94 layers x 128 experts per meta build: one layout (30B covers the rest)
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    for name, cfg in SHAPES.items():
        os.makedirs(root / name)
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root


COUNT = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from mgrpo.config import load_config
from mgrpo.plan import build_plan
root, layouts = sys.argv[1], json.loads(sys.argv[2])
out = {}
for name, lays in layouts.items():
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(f"{root}/{name}"))
    out[name] = {"hf": sum(p.numel() for p in hf.parameters()), "plans": []}  # a tied lm_head is listed once
    for lay in lays:  # dense (tp, pp): TP2 plans with DP2, replicas must not count twice
        tp, pp, ep, world, sp = lay if len(lay) == 5 else (*lay, 1, lay[0] * lay[1] * (2 if lay[1] == 1 else 1), 0)
        cfg = load_config(argv=["--model.path", f"{root}/{name}", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep),
                                "--model.params_dtype", "bfloat16"] + (["--sp"] if sp else []), check_files=False)
        plan = build_plan(cfg, world)
        stages = {r["pp"]: r["held"] - r["expert_held"] + r["expert_held"] * ep for r in plan["ranks"]}
        out[name]["plans"].append(dict(tp=tp, pp=pp, ep=ep, sp=sp, world=world, unique=plan["unique_total"],
                                       held=sum(stages.values()) * tp, expert_dp=plan["expert_dp"],
                                       experts=plan["unique_experts"]))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def counts(configs):
    """One process without a process group (the plan builds under torch's fake one): HF's count and each plan's."""
    proc = subprocess.run(
        [sys.executable, "-c", COUNT, str(configs), json.dumps(LAYOUTS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_unique_parameters_over_ranks_equal_hf(counts, name):
    want = counts[name]["hf"]
    for p in counts[name]["plans"]:
        assert p["unique"] == want, (name, p, p["unique"] - want)
        assert p["held"] >= want  # padding and replicated norms only add (experts: summed over EP ranks)
        ep = f"xEP{p['ep']}{' SP' if p['sp'] else ''}" if p["ep"] > 1 else ""
        edp = f" (expert-DP {p['expert_dp']})" if p["ep"] > 1 else ""
        print(f"{name} TP{p['tp']}xPP{p['pp']}{ep} on {p['world']} ranks{edp}: {p['unique']:,} = HF {want:,}")
    if "moe" in SHAPES[name]["model_type"]:
        cfg = SHAPES[name]
        experts = cfg["num_hidden_layers"] * cfg["num_experts"] * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
        assert all(p["experts"] == experts for p in counts[name]["plans"]), counts[name]["plans"]


def launch_env() -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def launch(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "launch/train_grpo.py", *args],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_72b_example_plans_16_ranks_and_stops_with_one_line_without_a_gpu():
    """Also, over the collective transport, the delta bases: each PP stage's sender keeps its own stage's (half of
    the 135.4 GiB bf16 model at PP 2), each server one whole copy on its first worker."""
    proc = launch(
        *("--config", "examples/qwen72b.yaml", "--tp", "8", "--pp", "2", "--print-plan", "--world-size", "16"),
        *("--rollout.remote.transport", "collective"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    line = next(x for x in out.splitlines() if x.startswith("delta base"))
    assert "each stage sender keeps its own stage's last version" in line and "67.7, 67.7 GiB" in line, line
    assert "each server keeps 135.4 GiB on its first worker" in line, line
    assert "layout: TP 8 x PP 2 x CP 1 x DP 1" in out and "TP     2 x 8: [0-7], [8-15]" in out
    assert "72,706,203,648 unique" in out  # Qwen2.5-72B's published count
    assert sum(1 for line in out.splitlines() if line.strip().split(" ")[0].isdigit()) == 16  # a row per rank
    proc = launch("--config", "examples/qwen72b.yaml", "--data.path", "examples/data/tiny_prompts.jsonl")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "run it on GPUs" in lines[0], proc.stderr[-2000:]


def test_the_72b_lora_example_counts_peft_trainable_parameters_on_8_ranks():
    """examples/qwen72b-lora.yaml: the trainable count equals PEFT's for the same targets and rank on HF's meta
    build; gradients and Adam state are the adapters' only (a full fine-tune's would be ~10x the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    proc = launch("--config", "examples/qwen72b-lora.yaml", "--print-plan", "--world-size", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(os.path.join(ROOT, "examples", "model_configs", "Qwen2.5-72B-Instruct"))
        )
        peft = get_peft_model(hf, LoraConfig(r=64, lora_alpha=128, target_modules="all-linear"))
    want = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    out = proc.stdout
    print(out)
    assert f"{want:,} trainable (PEFT's count), 72,706,203,648 frozen" in out
    assert "fused attention (TE/flash on GPU)" in out  # LoRA trains with TE's core attention on a GPU (actor.py)
    rows = [
        line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit() and len(line.split()) > 10
    ]
    weights, grads = float(rows[0][7]), float(rows[0][8])
    assert len(rows) == 8 and grads < weights / 10


def test_the_qwen3_30b_a3b_example_plans_ep8_on_8_ranks():
    proc = launch("--config", "examples/qwen3-30b-a3b.yaml", "--print-plan", "--world-size", "8", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "layout: TP 1 x PP 1 x CP 1 x DP 8" in out and "experts: expert-TP 1 x EP 8 x expert-DP 1 x PP 1" in out
    assert "EP     1 x 8: [0-7]" in out and "EXP-DP 8 x 1: [0], [1], [2], [3], ... (8 groups)" in out
    assert "128 per MoE layer (48 of 48 layers), top-8, expert FFN 768; 16 per EP rank (EP 8)" in out
    assert "30,532,122,624 unique" in out  # Qwen3-30B-A3B's count (HF, meta build of the published config)
    rows = [
        line.split() for line in out.splitlines() if line.strip().split(" ")[0].isdigit() and len(line.split()) > 10
    ]
    assert len(rows) == 8 and {r[7] for r in rows} == {"3,623,878,656"}  # 16 of 128 experts x 48 layers each
    print(out)


def test_expert_optimizer_state_is_sharded_over_expert_dp():
    """The distributed optimizer shards dense state over DP x CP and expert state over expert-DP (megatron's
    intra_expt_dp_group): at EP4 on 16 ranks DP is 16, expert-DP 4."""
    from mgrpo.config import load_config
    from mgrpo.models.hf_config import read_model_info
    from mgrpo.plan import StageParams, memory_estimate

    cfg = load_config(argv=["--config", "examples/qwen3-30b-a3b.yaml", "--ep", "4"], check_files=False)
    stage = StageParams(held=10_000, expert_held=6_000, layer_numbers=list(range(1, 49)), layers=48)
    m = memory_estimate(cfg, read_model_info(cfg.model.path), stage, 0, 16, 151936, expert_dp=4)
    assert m["optimizer"] == 10_000 * 12 and m["optimizer_distributed"] == 4_000 * 12 / 16 + 6_000 * 12 / 4


def test_layouts_that_do_not_divide_give_the_launch_errors(configs):
    from mgrpo.config import ConfigError, load_config
    from mgrpo.plan import print_plan

    with pytest.raises(
        ConfigError, match="parallel.tp=8 does not divide num_attention_heads=28 and num_key_value_heads=4"
    ):
        print_plan(["--config", "examples/qwen72b.yaml", "--model.path", str(configs / "qwen2.5-7b")], 16)
    with pytest.raises(ConfigError, match="world size 24 is not divisible by tp x pp x cp = 16"):
        print_plan(["--config", "examples/qwen72b.yaml"], 24)
    with pytest.raises(ConfigError, match=r"data.path='/path/to/gsm8k_train.jsonl' is the example's placeholder"):
        load_config(os.path.join(ROOT, "examples", "gsm8k.yaml"))


def test_the_memory_estimate_is_within_30_percent_of_measured_rss():
    """The tiny model at TP1 on a batch not used to choose the estimate's terms (benchmarks/memory_plan.py runs
    the ~100M model and TP2 x PP2 as well)."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/memory_plan.py", "--models", "tiny", "--layouts", "1x1", "--batches", "quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    print(proc.stdout)
    assert proc.stdout.strip().splitlines()[-1].endswith("within_30pct=1/1"), proc.stdout


def test_the_7b_example_prints_which_engine_holds_which_gpus_and_fits_only_asleep():
    """examples/qwen2.5-7b.yaml: TP2 x DP4, a TP2 engine per replica: each on its replica's two GPUs (the map
    `start_engine` prints at run time, from the same function); per GPU it fits an H100 because each engine sleeps
    while its replica trains, and would not without (the train phase with the engine's whole budget beside it)."""
    proc = launch("--config", "examples/qwen2.5-7b.yaml", "--print-plan", "--world-size", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[-14:]))
    line = next(x for x in lines if x.startswith("engines:"))
    assert line.startswith("engines: vllm#0 GPUs 0,1; vllm#1 GPUs 2,3; vllm#2 GPUs 4,5; vllm#3 GPUs 6,7"), line
    gpus = [x.split() for x in lines if x.strip().split(" ")[0].isdigit() and "vllm#" in x]
    assert [g[2] for g in gpus] == ["vllm#0", "vllm#0", "vllm#1", "vllm#1", "vllm#2", "vllm#2", "vllm#3", "vllm#3"]
    assert all(max(map(float, g[3:6])) < 79.6 < float(g[6]) for g in gpus), gpus  # as shipped / without sleep
    assert lines[-1].startswith("per GPU: largest ") and ": fits (without sleep/offload: " in lines[-1]


_PLANS: dict = {}
PLAN_32B = """
import json, sys
from mgrpo.config import load_config
from mgrpo.plan import build_plan, built_attention
cfg = load_config(argv=["--config", "examples/qwen2.5-32b.yaml"], check_files=False)
p = build_plan(cfg, 8, built_attention(cfg))
keep = ("world", "groups", "trainable", "unique_total", "attention")
print(json.dumps({**{k: p[k] for k in keep}, "ranks": [dict(rank=r["rank"], memory=r["memory"]) for r in p["ranks"]]}))
"""


def _gpu_plan(*argv, gpu="h100"):
    """The 32B example's per-GPU plan with `argv` (rollout settings only): the per-rank plan is built once, in a
    process of its own (it builds under a fake process group; a test worker may hold a real one)."""
    from mgrpo.config import load_config
    from mgrpo.models.hf_config import read_model_info
    from mgrpo.plan_gpu import GPU_GIB, format_gpu_plan, gpu_rows

    cfg = load_config(argv=["--config", "examples/qwen2.5-32b.yaml", *argv], check_files=False)
    if "plan" not in _PLANS:
        proc = subprocess.run(
            [sys.executable, "-c", PLAN_32B], cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env()
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        _PLANS["plan"] = dict(json.loads(proc.stdout.strip().splitlines()[-1]), info=read_model_info(cfg.model.path))
    plan = _PLANS["plan"]
    engine, rows = gpu_rows(cfg, plan, GPU_GIB[gpu] * 2**30)
    return cfg, plan, engine, rows, format_gpu_plan(cfg, plan, GPU_GIB[gpu])


def test_the_32b_lora_example_plans_each_gpu_from_the_published_shape():
    """examples/qwen2.5-32b.yaml (LoRA, TP4 x DP2, two TP4 engines): the engine's weights are HF's parameter count
    (a meta build of the published config) over its TP in bf16; its KV cache per token is 2 x layers x KV heads /
    TP x head_dim x 2 bytes (64, 8, 128: 64 KiB at TP4); the rollout phase is the trainer's resident state (frozen
    base, adapter grads and sharded Adam) beside the engine's whole budget; sleep frees that budget less what a
    sleeping vLLM keeps."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mgrpo.plan_gpu import CUDA_CONTEXT, ENGINE_ASLEEP, NCCL_BUFFERS

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(os.path.join(ROOT, "examples", "model_configs", "Qwen2.5-32B-Instruct"))
        )
    count = sum(p.numel() for p in hf.parameters())
    cfg, plan, engine, rows, lines = _gpu_plan()
    print("\n".join(lines))
    assert plan["attention"] == "flash"  # LoRA trains with TE's core attention on a GPU (actor.py)
    assert engine["weights"] == count * 2 / 4 and engine["kv_per_token"] == 64 * 1024
    gpu = 81559 / 1024 * 2**30
    m = plan["ranks"][0]["memory"]
    resident = m["weights"] + m["grads"] + m["optimizer_distributed"] + m["overhead"]
    contexts = 2 * CUDA_CONTEXT + 2 * NCCL_BUFFERS  # trainer and engine worker (TP4), each with NCCL
    assert [r["engine"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rows[0]["rollout"] == pytest.approx(resident + 0.6 * gpu + contexts)
    assert max(max(r["train"], r["push"], r["rollout"]) for r in rows) < gpu
    assert rows[0]["plain_train"] - rows[0]["train"] == pytest.approx(0.6 * gpu - ENGINE_ASLEEP)  # what sleep frees
    assert ": fits (without sleep/offload: " in lines[-1]


def test_the_gpu_plan_says_when_an_engine_does_not_fit():
    """Negative controls: the same example at utilization 0.7 fits asleep and not awake (sleep_level 0); a
    utilization that leaves the trainer too little, one its weights fill, or a context the KV cache cannot hold
    once, is refused in the verdict line; an H200 fits the awake engine."""
    hot = ["--rollout.vllm.gpu_memory_utilization", "0.7"]
    assert ": fits" in _gpu_plan(*hot)[-1][-1]  # asleep while training
    for argv, why in (
        (["--rollout.vllm.sleep_level", "0", *hot], "the train phase needs"),
        (["--rollout.vllm.gpu_memory_utilization", "0.9"], "the rollout phase needs"),
        (["--rollout.vllm.gpu_memory_utilization", "0.2"], "fill its budget"),
        (["--rollout.vllm.max_model_len", "32768", "--rollout.vllm.gpu_memory_utilization", "0.21"], "one sequence"),
    ):
        line = _gpu_plan(*argv)[-1][-1]
        assert "DOES NOT FIT" in line and why in line, (argv, line)
    assert ": fits" in _gpu_plan("--rollout.vllm.sleep_level", "0", *hot, gpu="h200")[-1][-1]
    from mgrpo.config import ConfigError
    from mgrpo.plan import take_plan_flags

    assert take_plan_flags(["--print-plan", "--plan-gpu", "h200"])[1]["gpu"] == "h200"
    with pytest.raises(ConfigError, match="--plan-gpu 'a100': use one of h100, h200"):
        take_plan_flags(["--plan-gpu", "a100"])
