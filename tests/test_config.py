"""Config loading, flag overrides, and validation that lists every error with the field and the fix."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from mgrpo.config import ConfigError, load_config, parse_overrides
from mgrpo.layout_checks import validate_layout
from mgrpo.models.hf_config import ModelConfigError, read_model_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch", "train_grpo.py")


def write_yaml(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return str(p)


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "hi"}) + "\n")
    return str(p)


def test_yaml_and_flags(tmp_path, data_file):
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}, "rollout": {"n": 2}})
    cfg = load_config(
        argv=[
            "--config",
            path,
            "--tp",
            "2",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--rollout.n",
            "8",
            "--algorithm.epsilon_high=0.28",
            "--sp",
        ]
    )
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.sp) == (2, 2, 2, True)
    assert cfg.rollout.n == 8 and cfg.algorithm.epsilon_high == 0.28


def test_unknown_keys_suggest_and_all_errors_listed(tmp_path, data_file):
    path = write_yaml(
        tmp_path,
        {"model": {"path": "m"}, "data": {"path": data_file}, "rollout": {"temprature": 0.7}, "paralel": {"tp": 2}},
    )
    with pytest.raises(ConfigError) as e:
        load_config(argv=["--config", path, "--rollout.n", "two"])
    msg = str(e.value)
    assert "unknown key 'rollout.temprature'; did you mean 'temperature'?" in msg
    assert "unknown key 'paralel'; did you mean 'parallel'?" in msg
    assert "rollout.n: expected int" in msg
    assert len(e.value.errors) == 3


def test_overrides_parse():
    assert parse_overrides(["--config", "x.yaml", "--cp", "2", "--rollout.n", "8"]) == (
        "x.yaml",
        {"parallel": {"cp": 2}, "rollout": {"n": 8}},
    )
    assert load_config(argv=["--train.lr", "1e-5", "--model.path", "m"], check_files=False).train.lr == 1e-5
    with pytest.raises(ConfigError, match="unknown flag --bogus"):
        parse_overrides(["--bogus", "1"])


def _info(tiny_dirs, **kw):
    return read_model_info(tiny_dirs("cfg_" + "_".join(f"{k}{v}" for k, v in sorted(kw.items())), **kw))


def test_layout_checks(tiny_dirs, data_file, tmp_path):
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    info = _info(tiny_dirs, family="qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    cfg = load_config(argv=["--config", path, "--tp", "8", "--pp", "2", "--vpp", "2"])
    errs = validate_layout(cfg, info, world_size=12, cuda=False)
    text = "\n".join(errs)
    assert "parallel.tp=8 does not divide num_attention_heads=4" in text
    assert "parallel.pp x parallel.vpp = 4 does not divide num_hidden_layers=2" in text
    assert "world size 12 is not divisible by tp x pp x cp = 16" in text
    tied = _info(tiny_dirs, family="qwen2", num_layers=2, tie_word_embeddings=True)
    cfg = load_config(argv=["--config", path, "--pp", "2"])
    assert any("tie_word_embeddings=true is not supported on CPU" in e for e in validate_layout(cfg, tied, 2, False))
    assert not validate_layout(cfg, tied, 2, cuda=True)
    cfg = load_config(argv=["--config", path, "--rollout.prompts_per_step", "3", "--rollout.n", "1"])
    assert any("not divisible by data-parallel size 2" in e for e in validate_layout(cfg, info, 2, False))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="architecture 'GPT2LMHeadModel' is not supported"):
        read_model_info(str(tmp_path))


def run_launch(args, world_size=1):
    """The launcher as torchrun's rank 0 would start it; validation fails before any group is created."""
    from mgrpo.parallel.distributed import free_port

    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    return subprocess.run(
        [sys.executable, LAUNCH, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )


@pytest.mark.parametrize(
    "case",
    [
        "tp_heads",
        "pp_layers",
        "world",
        "arch",
        "tied_pp",
        "yaml_key",
        "missing_data",
        "row_without_prompt",
        "dp_divisible",
        "missing_shard",
        "clip_ratio_c",
        "pp_micro_batch",
        "lr_negative",
        "lr_zero",
        "ep_dense",
        "typo_model_path",
        "tau_neg",
        "entropy_quantile",
    ],
)
def test_launcher_bad_input_exits_nonzero_with_one_line(case, tmp_path, tiny_dirs):
    model = tiny_dirs("launch_qwen2", family="qwen2", num_layers=2)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    base = {"model": {"path": model}, "data": {"path": str(data)}, "logging": {"output_dir": str(tmp_path / "o")}}
    args, world = [], 1
    if case == "tp_heads":
        args, world, expect = ["--tp", "3"], 3, "parallel.tp=3 does not divide num_attention_heads=4"
    elif case == "pp_layers":
        args, world, expect = ["--pp", "4"], 4, "parallel.pp x parallel.vpp = 4 does not divide num_hidden_layers=2"
    elif case == "world":
        args, expect = ["--tp", "2"], "world size 1 is not divisible by tp x pp x cp = 2"
    elif case == "arch":
        bad = tmp_path / "bad_model"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
        base["model"]["path"] = str(bad)
        expect = "architecture 'BertModel' is not supported"
    elif case == "tied_pp":
        base["model"]["path"] = tiny_dirs("launch_tied", family="qwen2", num_layers=2, tie_word_embeddings=True)
        args, world, expect = ["--pp", "2"], 2, "tie_word_embeddings=true is not supported on CPU"
    elif case == "yaml_key":
        base["rollout"] = {"max_token": 8}
        expect = "unknown key 'rollout.max_token'; did you mean 'max_tokens'?"
    elif case == "missing_data":
        base["data"]["path"] = str(tmp_path / "nope.jsonl")
        expect = "nope.jsonl': not found"
    elif case == "row_without_prompt":
        data.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "x"}) + "\n")
        expect = "row 1: no prompt"
    elif case == "dp_divisible":
        args, world = ["--rollout.prompts_per_step", "3", "--rollout.n", "1"], 2
        expect = "rollout.prompts_per_step x rollout.n = 3 is not divisible by data-parallel size 2"
    elif case == "clip_ratio_c":
        args, expect = ["--algorithm.clip_ratio_c", "0.8"], "algorithm.clip_ratio_c=0.8 must be > 1"
    elif case == "pp_micro_batch":
        args, world = (
            ["--pp", "2", "--rollout.prompts_per_step", "4", "--rollout.n", "4", "--train.micro_batch_size", "5"],
            2,
        )
        expect = "train.micro_batch_size=5 does not divide the per-DP-rank mini-batch of 16 samples"
    elif case in ("lr_negative", "lr_zero"):  # its own message, not warmup_steps' or min_lr's
        value = "-1" if case == "lr_negative" else "0"
        args, expect = ["--train.lr", value], f"train.lr={float(value)} must be > 0"
    elif case == "ep_dense":
        args, world = ["--ep", "2"], 2
        expect = f"parallel.ep=2 needs a mixture-of-experts model; {model} (Qwen2ForCausalLM) has none"
    elif case == "typo_model_path":  # the YAML's tiny model is for the YAML's path, not for a typo on the command line
        base["model"] = {"path": str(tmp_path / "yaml_model"), "tiny": {"family": "qwen2", "num_layers": 2}}
        args = ["--model.path", str(tmp_path / "typo")]
        expect = f"{tmp_path / 'typo'}/config.json: not found; model.path must be an HF model folder"
    elif case == "tau_neg":
        args = ["--algorithm.loss_type", "sapo", "--algorithm.tau_neg", "-1"]
        expect = "algorithm.tau_neg=-1.0 must be > 0"
    elif case == "entropy_quantile":
        args = ["--algorithm.top_entropy_quantile", "1.5"]
        expect = "algorithm.top_entropy_quantile=1.5 must be in (0, 1]"
    elif case == "missing_shard":
        from safetensors.torch import load_file

        from mgrpo.weights.hf_writer import write_hf_folder

        sharded = tmp_path / "sharded"
        tensors = load_file(os.path.join(model, "model.safetensors"))
        write_hf_folder(iter(tensors.items()), str(sharded), model, max_shard_bytes=200_000)
        shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
        os.remove(sharded / shards[-1])
        base["model"]["path"] = str(sharded)
        expect = f"{shards[-1]}: checkpoint shard is missing"
    r = run_launch(["--config", write_yaml(tmp_path, base), *args], world)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got: {lines}"
    assert expect in lines[0], lines[0]
    assert not (tmp_path / "o").exists(), "nothing is written before validation passes"
    assert not (tmp_path / "typo").exists() and not (tmp_path / "yaml_model").exists()


# ------------------------------------------------------------------ presets fill only what the user left unset
def test_flags_beat_presets(tmp_path, data_file):
    from mgrpo.config import describe_algorithm

    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    cfg = load_config(
        argv=[
            "--config",
            path,
            "--algorithm.loss_type",
            "dapo",
            "--algorithm.epsilon_high",
            "0.35",
            "--algorithm.aggregation",
            "seq-mean-token-mean",
        ]
    )
    a = cfg.algorithm
    assert (a.aggregation, a.epsilon_high, a.epsilon_low, a.policy_loss) == (
        "seq-mean-token-mean",
        0.35,
        0.2,
        "ppo_clip",
    )
    text = describe_algorithm(cfg)
    assert "epsilon_high           0.35" in text and "(flag)" in text
    assert "epsilon_low            0.2                      (preset dapo)" in text
    assert "kl_coef                0.0                      (default)" in text
    cfg = load_config(argv=["--config", path, "--algorithm.loss_type", "grpo", "--algorithm.policy_loss", "gspo"])
    assert cfg.algorithm.policy_loss == "gspo" and cfg.algorithm.aggregation == "seq-mean-token-mean"
    assert cfg.algorithm.epsilon_low is None, "gspo keeps its own epsilons (3e-4 / 4e-4)"
    assert "epsilon_low            0.0003                   (default = gspo's default)" in describe_algorithm(cfg)
    # dapo's clip-higher epsilons and token-mean belong to ppo_clip: a user-chosen policy loss does not inherit them
    cfg = load_config(argv=["--config", path, "--algorithm.loss_type", "dapo", "--algorithm.policy_loss", "gspo"])
    assert cfg.algorithm.epsilon_high is None and cfg.algorithm.aggregation == "seq-mean-token-mean"


@pytest.mark.parametrize(
    "loss,expect",
    [
        ("gspo", "seq-mean-token-mean"),
        ("gspo_token", "seq-mean-token-mean"),
        ("ppo_clip", "token-mean"),
        ("cispo", "token-mean"),
        ("sapo", "seq-mean-token-mean"),
    ],
)
def test_each_policy_loss_brings_its_aggregation(tmp_path, data_file, loss, expect):
    """GSPO is sequence-level (its paper, eq. 5; verl's compute_policy_loss_gspo): with no aggregation set it runs
    seq-mean-token-mean, not the global token-mean it inherited before (the negative control: that value fails the
    first assertion for gspo); the run header says which and where it came from; a user's value wins."""
    from mgrpo.config import describe_algorithm

    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    cfg = load_config(argv=["--config", path, "--algorithm.policy_loss", loss])
    assert cfg.algorithm.aggregation == expect
    header = describe_algorithm(cfg)
    assert f"aggregation            {expect:<24} ({loss}'s default)" in header
    for field in ("policy_loss", "rollout_is_mode", "kl_estimator"):
        assert f"\n  {field} " in header, field
    cfg = load_config(
        argv=["--config", path, "--algorithm.policy_loss", loss, "--algorithm.aggregation", "seq-mean-token-sum"]
    )
    assert cfg.algorithm.aggregation == "seq-mean-token-sum"
    assert "aggregation            seq-mean-token-sum       (flag)" in describe_algorithm(cfg)


def test_yaml_beats_preset_and_flag_beats_yaml(tmp_path, data_file):
    from mgrpo.config import describe_algorithm

    path = write_yaml(
        tmp_path,
        {
            "model": {"path": "m"},
            "data": {"path": data_file},
            "algorithm": {"loss_type": "dapo", "epsilon_high": 0.3, "aggregation": "token-mean"},
        },
    )
    cfg = load_config(argv=["--config", path, "--algorithm.aggregation", "seq-mean-token-sum"])
    assert cfg.algorithm.epsilon_high == 0.3 and cfg.algorithm.aggregation == "seq-mean-token-sum"
    text = describe_algorithm(cfg)
    assert "(yaml)" in text and "note: preset dapo would set epsilon_high=0.28; the yaml value 0.3 wins" in text
    # untouched fields still come from the preset
    cfg = load_config(argv=["--config", path])
    assert cfg.algorithm.epsilon_low == 0.2 and cfg.algorithm.scale_rewards == "group"


def test_algorithm_numbers_all_reported_at_once(tmp_path, data_file):
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    with pytest.raises(ConfigError) as e:
        load_config(
            argv=[
                "--config",
                path,
                "--algorithm.clip_ratio_c",
                "1.0",
                "--algorithm.epsilon_low",
                "1.0",
                "--algorithm.epsilon_high",
                "-0.1",
                "--algorithm.kl_coef",
                "-0.01",
                "--algorithm.rollout_is_mode",
                "tis",
                "--algorithm.rollout_is_threshold",
                "2.0",
                "--algorithm.rollout_is_lower",
                "2.0",
            ]
        )
    fields = ["clip_ratio_c=1.0", "epsilon_low=1.0", "epsilon_high=-0.1", "kl_coef=-0.01", "rollout_is_lower=2.0"]
    assert len(e.value.errors) == len(fields)
    for f, line in zip(fields, e.value.errors):
        assert f"algorithm.{f}" in line and "use" in line
    with pytest.raises(
        ConfigError,
        match=r"algorithm.epsilon_high=1.0 is CISPO's absolute cap on the ratio and must "
        r"be > 1",
    ):
        load_config(argv=["--config", path, "--algorithm.loss_type", "cispo", "--algorithm.epsilon_high", "1.0"])
    # the preset's own values pass, and valid numbers are not flagged
    for preset in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"):
        load_config(argv=["--config", path, "--algorithm.loss_type", preset])
    load_config(
        argv=[
            "--config",
            path,
            "--algorithm.clip_ratio_c",
            "3.0",
            "--algorithm.epsilon_low",
            "0",
            "--algorithm.rollout_is_lower",
            "0.5",
        ]
    )


def test_pp_micro_batch_must_divide_the_dp_batch(tiny_dirs, data_file, tmp_path):
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    info = _info(tiny_dirs, family="qwen2", num_layers=2, num_heads=4, num_kv_heads=2)
    argv = ["--config", path, "--pp", "2", "--rollout.prompts_per_step", "6", "--rollout.n", "2"]
    bad = load_config(argv=argv + ["--train.micro_batch_size", "5"])
    errs = validate_layout(bad, info, world_size=4, cuda=False)  # DP 2: 6 samples per DP rank
    assert errs == [
        "train.micro_batch_size=5 does not divide the per-DP-rank mini-batch of 6 samples "
        "(prompts_per_step x n / steps_per_generation / DP); with parallel.pp > 1 every micro-batch "
        "must have the same size: use a divisor such as 3"
    ]
    for ok in ("3", "6", "8"):  # 8 > 6: one micro-batch of 6
        assert not validate_layout(load_config(argv=argv + ["--train.micro_batch_size", ok]), info, 4, False)
    no_pp = [a for a in argv if a not in ("--pp", "2")] + ["--rollout.n", "2", "--train.micro_batch_size", "5"]
    assert not validate_layout(load_config(argv=no_pp), info, 2, False), "without PP a short micro-batch is fine"


def test_every_example_config_loads_and_validates():
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(glob.glob(os.path.join(root, "examples", "*.yaml")))
    assert len(paths) >= 2
    for path in paths:
        cfg = load_config(path, [], check_files=False)
        assert cfg.train.steps >= 1, path


def test_scheduler_fields_all_reported_at_once(tmp_path, data_file):
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    with pytest.raises(ConfigError) as e:
        load_config(
            argv=[
                "--config",
                path,
                "--rollout.scheduler",
                "gyms",
                "--rollout.max_turns",
                "0",
                "--rollout.max_concurrent",
                "0",
                "--rollout.max_total_tokens",
                "1",
            ]
        )
    assert len(e.value.errors) == 4
    assert "rollout.scheduler='gyms' is unknown; did you mean 'gym'?" in e.value.errors[0]
    for field, line in zip(("max_turns=0", "max_concurrent=0", "max_total_tokens=1"), e.value.errors[1:]):
        assert f"rollout.{field}" in line
    for name in (
        "gym",
        "gym_scheduler",
        "tool_call",
        "tool_call_scheduler",
        "math_tips",
        "math_tip_trick",
        "single_turn",
    ):
        assert load_config(argv=["--config", path, "--rollout.scheduler", name]).rollout.scheduler == name


def test_the_yaml_tiny_model_is_only_for_the_yaml_path(tmp_path):
    """model.tiny applies to the path named beside it; a --model.path flag turns it off unless --model.tiny (or a
    --model.tiny.* key) is given too."""
    yaml_file = os.path.join(ROOT, "examples", "tiny_cpu.yaml")
    kept = load_config(yaml_file, check_files=False)
    assert kept.model.tiny is not None and kept.model.path == "outputs/tiny_cpu/model"
    other = str(tmp_path / "other")
    assert load_config(yaml_file, ["--model.path", other], check_files=False).model.tiny is None
    for extra in (["--model.tiny"], ["--model.tiny.num_layers", "3"], ["--model.tiny.num_layers", "3", "--model.tiny"]):
        cfg = load_config(yaml_file, ["--model.path", other, *extra], check_files=False)
        assert cfg.model.tiny is not None and cfg.model.tiny.hidden_size == 128, extra
        assert cfg.model.tiny.num_layers == (3 if len(extra) > 1 else 4), extra


@pytest.mark.parametrize(
    "flags,expect",
    [
        (["--rollout.vllm.sleep_level", "3"], "rollout.vllm.sleep_level=3; use 0"),
        (["--train.offload", "gpu"], "train.offload='gpu'; use none, optimizer"),
        (["--train.offload", "all"], "rollout.engine='hf' has none"),
        (
            ["--rollout.engine", "vllm", "--rollout.vllm.sleep_level", "1", "--rollout.mode", "async"],
            "use rollout.mode sync",
        ),
        (["--rollout.engine", "vllm", "--train.offload", "all", "--checkpoint.async_save", "true"], "drop one"),
        (
            ["--rollout.engine", "vllm", "--rollout.vllm.sleep_level", "2"]
            + ["--model.lora.rank", "8", "--rollout.lora_sync", "adapter"],
            "vllm#29341",
        ),
    ],
)
def test_colocated_turns_refuse_what_cannot_take_turns(tmp_path, data_file, flags, expect):
    """rollout.vllm.sleep_level / train.offload (rollout/colocate.py): a colocated engine, a synchronous loop, no
    asynchronous save reading parked tensors, no level-2 sleep that adapter-only sync never refills."""
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    with pytest.raises(ConfigError) as e:
        load_config(argv=["--config", path, *flags])
    assert expect in str(e.value), str(e.value)
    load_config(
        argv=["--config", path, "--rollout.engine", "vllm", "--rollout.vllm.sleep_level", "2", "--train.offload", "all"]
    )


def test_delta_sync_fields_are_checked(tmp_path, data_file):
    """rollout.remote.delta with SGLang (its receiver takes whole tensors) and a negative full_every: both named;
    deltas over the collective transport to vLLM servers are accepted."""
    path = write_yaml(tmp_path, {"model": {"path": "m"}, "data": {"path": data_file}})
    with pytest.raises(ConfigError) as e:
        load_config(
            argv=[
                "--config",
                path,
                "--rollout.engine",
                "sglang",
                "--rollout.servers",
                "http://127.0.0.1:8000",
                "--rollout.remote.delta",
                "true",
                "--rollout.remote.full_every",
                "-1",
            ],
            check_files=False,
        )
    text = str(e.value)
    assert "rollout.remote.delta=true with rollout.engine=sglang" in text, text
    assert "rollout.remote.full_every" in text, text
    argv = ["--config", path, "--rollout.engine", "remote", "--rollout.servers", "http://127.0.0.1:8000"]
    cfg = load_config(
        argv=argv + ["--rollout.remote.transport", "collective", "--rollout.remote.delta", "true"], check_files=False
    )
    assert cfg.rollout.remote.delta and cfg.rollout.remote.transport == "collective"
