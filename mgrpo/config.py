"""Typed run configuration: YAML -> dataclasses, CLI overrides, validation that lists every error.

`load_config(path, argv)` reads the YAML, applies `--tp/--pp/--cp/--vpp` and dotted flags such as
`--rollout.n 8`, and validates everything at once before any process group or file is touched.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from mgrpo.config_checks import suggest, validate_config
from mgrpo.models.moe_options import MoeConfig  # read by the model builder, below this layer


class ConfigError(ValueError):
    """Raised with every problem found; str() gives one line per problem."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(f"config error: {e}" for e in self.errors))


@dataclass
class WarmStartConfig:
    """A short supervised pass on generated addition before RL (mgrpo.cli.warm_start); problems in eval.path
    (its a and b columns) are left out."""

    task: str = "addition"
    steps: int = 500
    lr: float = 3e-3
    batch_size: int = 32
    low: int = 0  # operands in [low, high]
    high: int = 99
    seed: int = 0


@dataclass
class TinyModelConfig:
    """Make a random tiny HF model (tests, embedded default) instead of reading `model.path`."""

    family: str = "qwen2"
    vocab_size: int = 300
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 256
    tie_word_embeddings: bool = False
    seed: int = 0
    num_experts: int = 8  # qwen3_moe only: experts per MoE layer, experts per token, and each expert's width
    experts_per_token: int = 2
    moe_ffn_hidden_size: int = 64
    initializer_range: float = 0.02  # HF's init std (the LoRA example's 0.1 gives a low-rank adapter logits to move)
    warm_start: Optional[WarmStartConfig] = None  # e.g. {steps: 350}: supervised addition before RL


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (models/lora.py); rank 0 = full-parameter training."""

    rank: int = 0
    alpha: float = 16.0  # scaling = alpha / rank, as PEFT
    dropout: float = 0.0
    target_modules: list = field(default_factory=lambda: ["all-linear"])  # HF names (q_proj ... down_proj)


@dataclass
class ModelConfig:
    path: str = ""  # HF folder (config.json, safetensors, tokenizer)
    tiny: Optional[TinyModelConfig] = None  # if set, a tiny model is written to `path` when it is missing
    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "float32"  # float32 | bfloat16
    moe: MoeConfig = field(default_factory=MoeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    fusions: str = "auto"  # auto: megatron's fused kernels where CUDA (and TE) are present | off (models/fast_paths.py)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None  # virtual pipeline chunks per PP rank
    cp: int = 1
    ep: int = 1
    sp: bool = False  # sequence parallelism (needs tp > 1)
    batch_p2p_comm: Optional[bool] = None  # None: False on gloo (True is silently wrong at PP2xVPP2), True on nccl


@dataclass
class VLLMConfig:
    """The colocated vLLM engine (rollout.engine: vllm), a child process of its owner rank."""

    dtype: str = "auto"  # auto: float32 on CPU (exact logprobs), bfloat16 on GPU
    kv_cache_gb: float = 1.0  # CPU: VLLM_CPU_KVCACHE_SPACE per engine
    gpu_memory_utilization: float = 0.5  # GPU: the engine's share, the trainer holds the rest
    tensor_parallel_size: int = 1
    max_model_len: Optional[int] = None  # null: the model's
    enforce_eager: bool = True
    start_timeout_s: float = 600.0
    update_ring: Optional[int] = None  # weight buffers; 0 = stage the whole update (all or nothing; CPU default),
    #                                    k >= 2 = stream through k buckets (bounded memory; GPU default 2)
    update_checksum: bool = False  # sha256 every bucket (the buffers never leave the machine)
    sleep_level: int = 0  # 0 awake | 1 weights to host, KV cache dropped | 2 both dropped, while the trainer trains
    # CPU cores the engine's processes run on (os.sched_setaffinity; null: the owner's): keeps a CPU engine off the
    # trainer's cores, e.g. benchmarks/async_rollout.py's two emulated machines
    cpu_affinity: Optional[list] = None


@dataclass
class RemoteConfig:
    """rollout.engine: remote: guarded rollout servers (launch/rollout_server.py), each a replica."""

    token_file: str = ""  # file holding the servers' token; MGRPO_SERVER_TOKEN wins when set
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 30.0  # one generation request; past it the server is excluded and it is retried
    max_inflight_per_server: int = 64
    retries: int = 2  # a failed generation request is retried on another server, with backoff
    backoff_s: float = 0.5  # doubled after each retry
    update_timeout_s: float = 600.0  # one bucket or commit of a weight update
    allow_plain_http: bool = False  # http:// to a server off loopback (the token travels in clear); else https
    ca_file: str = ""  # CA (or the servers' self-signed certificate) that https:// servers are checked against
    checksum: str = "xxh3_128"  # per-bucket digest on the wire: xxh3_128 (corruption, ~12 GB/s) | sha256
    delta: bool = (
        False  # HTTP or collective (vLLM): send what changed since the servers' version (docs/weight-sync.md#deltas)
    )
    full_every: int = 0  # with delta: a full push every N versions (0: only when a server needs one)
    max_consecutive_failures: int = 3  # a replica is excluded after this many failed requests in a row
    run_id: str = ""  # this trainer run on the servers; "": random for a fresh run, the checkpoint's on --resume
    take_over: bool = False  # update servers that another trainer run owns (logged there); else they answer 409
    transport: str = "auto"  # auto (http for remote, collective for sglang) | http (buckets, TLS) | collective
    collective_bind: str = "127.0.0.1"  # the address the senders' collective data connections use


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf (in-process) | vllm (colocated child) | remote (vLLM servers) | sglang (SGLang servers)
    engine_placement: str = "rank0"  # rank0: one engine on global rank 0 | per_dp: one per data-parallel group
    mode: str = "sync"  # sync | one_step_off | async: generation of later batches overlaps training (producer.py)
    max_staleness: Optional[int] = None  # versions a trained sample may lag (one_step_off: 1; async: default 2)
    # one_step_off / async with the vllm engine: a push holds the requests in flight and continues them on the
    # new weights (every token carries its version: Sample.token_versions); off: a push waits for them
    partial: bool = False
    recompute_kv_after_update: bool = False  # partial: held requests prefill again under the new weights (exact)
    max_num_seqs: int = 256  # rows per forward batch inside an engine (memory bound)
    max_inflight: int = 256  # single turn: requests per engine call; several in flight only for async engines
    request_timeout_s: float = 600.0  # an engine call that takes longer fails the step, naming the engine
    n: int = 4  # samples per prompt (group size)
    prompts_per_step: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; the engine samples with exactly temperature/top_p/top_k, nothing from generation_config
    max_tokens: int = 32
    ignore_eos: bool = (
        False  # every response runs to its max_tokens (verl's rollout.ignore_eos; benchmarks: fixed lengths)
    )
    update_bucket_mb: int = 256  # weight-sync bucket size
    lora_sync: str = "merged"  # LoRA runs: merged (base + B·A, any engine) | adapter (PEFT adapter only, vLLM engines)
    scheduler: Optional[str] = (
        None  # null: single turn, batched | tool_call | math_tips | gym | single_turn | a plugin's
    )
    scheduler_kwargs: dict = field(default_factory=dict)  # to the scheduler, e.g. {gym_env: guess_number}
    max_turns: Optional[int] = None  # engine calls per trajectory; null: until the scheduler stops (ms-swift)
    max_concurrent: int = 64  # trajectories in flight per engine (each has at most one request at the engine)
    max_total_tokens: Optional[int] = None  # prompt + all turns; null: the engine's context (max_model_len)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    servers: list = field(default_factory=list)  # rollout.engine: remote: [http://host:port, ...] (or "a,b")
    remote: RemoteConfig = field(default_factory=RemoteConfig)


@dataclass
class AlgorithmConfig:
    loss_type: Optional[str] = None  # ms-swift preset: grpo|bnpo|dr_grpo|dapo|cispo|sapo; fills only unset fields
    advantage: str = "grpo"  # grpo | rloo | reinforce_plus_plus (ms-swift) | reinforce_plus_plus_baseline (verl)
    scale_rewards: Optional[str] = None  # group | batch | none; null = the estimator's default
    policy_loss: str = "ppo_clip"  # ppo_clip | gspo | gspo_token | cispo | sapo
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm; null = the policy loss's own
    # (ppo_clip, cispo: token-mean; gspo, gspo_token, sapo: seq-mean-token-mean; mgrpo/loss/policy.py)
    aggregation: Optional[str] = None
    epsilon_low: Optional[float] = None  # null = the policy loss's default (ppo_clip 0.2, gspo 3e-4)
    epsilon_high: Optional[float] = None  # (ppo_clip 0.2, gspo 4e-4, cispo: absolute ratio cap 5.0)
    clip_ratio_c: Optional[float] = None  # dual clip where A < 0 (> 1; verl uses 3.0); null = off, as ms-swift
    tau_pos: float = 1.0  # SAPO's gate temperature where A > 0 (ms-swift --tau_pos; the paper's default)
    tau_neg: float = 1.05  # SAPO's gate temperature where A < 0 (ms-swift --tau_neg; the paper's default)
    top_entropy_quantile: float = 1.0  # < 1: only the mini-batch's top-q entropy tokens train (1.0 = off)
    routing_replay: bool = False  # MoE: route tokens to the experts the engine chose (R3; mgrpo/models/routing.py)
    kl_coef: float = 0.0  # > 0 loads a frozen reference policy (the initial weights)
    kl_estimator: str = "k3"  # k1 | k2 | k3 as a loss term
    kl_in_reward: bool = False  # subtract kl_coef * k1 (per sequence) from the reward instead
    entropy_coef: float = 0.0  # entropy bonus
    rollout_is_mode: Optional[str] = None  # token_* | seq_geomean_* | seq_product_* with *=truncate|mask (see loss)
    rollout_is_threshold: float = 2.0
    rollout_is_lower: Optional[float] = None
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards all agree, re-sample new prompts in their place
    max_resample_times: int = 3  # extra generation rounds per step for dynamic sampling (ms-swift's name)
    overlong_filter: bool = False  # truncated samples (finish_reason == "length") get loss mask 0


@dataclass
class RewardConfig:
    funcs: list = field(default_factory=lambda: ["token_fraction"])
    weights: Optional[list] = None
    kwargs: dict = field(default_factory=dict)  # passed to every reward function by name
    timeout_s: float = 10.0  # per isolated reward call (math-verify) and per async reward function
    workers: int = 2  # processes for isolated rewards (a call past timeout_s is killed; the sample fails)


@dataclass
class DataConfig:
    path: str = ""  # .jsonl, .json, .parquet or a save_to_disk folder with a `prompt` or `messages` column
    prompt_key: str = "prompt"  # a string column
    messages_key: str = "messages"  # a chat list column ({role, content}); used when the row has it
    apply_chat_template: bool = True
    shuffle: bool = True  # a new order every epoch, fixed by train.seed
    max_prompt_length: Optional[int] = None  # tokens; longer prompts are dropped at load and counted (null: keep all)


@dataclass
class EvalConfig:
    """Validation on a held-out prompt file every `interval` steps (off by default); metrics under val/."""

    path: str = ""  # same formats and columns as data.path
    interval: int = 0  # steps; 0 = never. Also after the last step
    n: int = 1  # samples per prompt; pass@k needs n >= k
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: Optional[int] = None  # null: rollout.max_tokens
    k: list = field(default_factory=list)  # pass@k for each k (pass@1 always); e.g. [4, 8] with n: 8
    pass_reward: Optional[str] = None  # the reward function whose score decides a pass (null: the weighted total)
    pass_threshold: float = 1.0  # a sample passes when that score is >= this
    before_train: bool = False  # also validate the initial weights (verl's val_before_train), logged as step -1


@dataclass
class TrainConfig:
    steps: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    micro_batch_size: int = 4  # samples per micro-batch on each DP rank
    max_tokens_per_microbatch: int = 0  # > 0: micro-batches by token budget (verl's use_dynamic_bsz), DP-balanced
    sequence_packing: bool = False  # padding-free rows (verl's use_remove_padding, ms-swift's padding_free)
    steps_per_generation: int = 1  # mini-batches per generation batch, one optimizer step each (TRL's name)
    num_iterations: int = 1  # times the whole generation batch is replayed (verl ppo_epochs, TRL num_iterations)
    lr_schedule: str = "constant"  # constant | linear | cosine (megatron's OptimizerParamScheduler)
    warmup_steps: int = 0  # optimizer steps of linear warmup: step k of W trains at lr * k / W
    min_lr: float = 0.0  # where linear/cosine decay ends (at the last optimizer step)
    use_distributed_optimizer: bool = False
    offload: str = "none"  # none | optimizer | optimizer+grads | all: to host memory while a colocated engine generates
    recompute: str = "none"  # none | selective (core attention) | full (every layer from its input): activations
    step_timeout_s: Optional[float] = None  # a step past it: stacks to OUTPUT_DIR/hang, one line, exit 3; null =
    # 1800 s until a step finishes, then 10 x the slowest step (>= 300 s); 0 = off (mgrpo/parallel/watchdog.py)
    overlap_grad_reduce: Optional[bool] = None  # null: on with the distributed optimizer on a GPU
    overlap_param_gather: Optional[bool] = None  # null: as overlap_grad_reduce (distributed optimizer only)
    seed: int = 1234


@dataclass
class CheckpointConfig:
    save_dir: str = ""  # step_XXXXXX folders with the whole training state, and `latest`; see mgrpo/checkpoint.py
    save_interval: int = 0  # every N steps and at the end; 0 = never
    keep_last: int = 0  # keep the newest N checkpoints (pruned only after a new one is complete); 0 = keep all
    resume: str = ""  # "" = fresh run; "latest" (the --resume flag) = SAVE_DIR/latest; "auto" = latest if a
    # checkpoint exists, else a fresh run (torchrun --max-restarts, verl's resume_mode auto); or a step_XXXXXX folder
    export_hf_at_end: bool = False  # also write SAVE_DIR/hf_step_XXXXXX (the converter's HF folder) for the last step
    async_save: bool = False  # megatron's asynchronous save: shards are written while the next steps run
    # the distributed optimizer's state: false = each rank writes its own shard (megatron's dp_reshardable; resume
    # at the same TP/PP/CP/EP, DP may change); true = layout-free (fully_reshardable: every save gathers the whole
    # fp32 state of a model-parallel group on its DP rank 0, host memory included), for resuming at another layout
    reshardable: bool = False


@dataclass
class WandbConfig:
    project: str = "mgrpo"
    name: Optional[str] = None  # null: wandb picks one
    mode: Optional[str] = None  # online | offline | disabled; null: wandb's default (WANDB_MODE)


@dataclass
class LoggingConfig:
    output_dir: str = "outputs/run"  # metrics.jsonl, config.yaml, completions.jsonl, report.png, tensorboard/, wandb/
    progress_bar: bool = True
    tensorboard: bool = False  # event files in OUTPUT_DIR/tensorboard
    wandb: Optional[WandbConfig] = None  # e.g. {project: grpo, name: qwen7b, mode: offline}
    completions_interval: int = 10  # completions.jsonl every N steps (and the first); 0 = never
    completions_token_ids: bool = False  # also write prompt/response token ids
    log_entropy: bool = False  # also write each response token's entropy (the rollout policy's) to completions
    report: bool = True  # report.png at the end of the run (also: python -m mgrpo.report OUTPUT_DIR)
    overwrite: bool = False  # an output_dir holding an earlier run: false refuses, true removes that run's files


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    external_plugins: list = field(default_factory=list)  # .py files that register rewards/schedulers/envs/losses


SHORT_FLAGS = {
    "--tp": "parallel.tp",
    "--pp": "parallel.pp",
    "--cp": "parallel.cp",
    "--vpp": "parallel.vpp",
    "--ep": "parallel.ep",
    "--sp": "parallel.sp",
}


def _dataclass_type(tp):
    """The dataclass inside Optional[X], or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


@functools.lru_cache(maxsize=None)
def _adapter(tp):
    import pydantic

    return pydantic.TypeAdapter(tp)


def _coerce(value: Any, tp, where: str, errors: list[str]):
    """One field's value checked against its annotation by pydantic v2 in strict mode (an int is not a bool, a
    string is not a number: YAML already typed every value), with one exception: YAML 1.1 reads 1e-5 (no dot) as
    a string, so a float field takes a string that parses as one."""
    import pydantic

    if value is None and type(None) not in typing.get_args(tp):
        errors.append(f"{where}: null is not allowed; give a value")
        return None
    try:
        return _adapter(tp).validate_python(value, strict=True)
    except pydantic.ValidationError:
        if isinstance(value, str) and float in typing.get_args(tp) + (tp,):
            try:
                return float(value)
            except ValueError:
                pass
        base = (
            [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
        )
        name = getattr(typing.get_origin(base[0]) or base[0], "__name__", str(base[0]))
        errors.append(f"{where}: expected {name}, got {value!r}")
        return None


def _build(cls, data: dict, where: str, errors: list[str]):
    if not isinstance(data, dict):
        errors.append(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            errors.append(f"unknown key '{path}'{suggest(str(key), names)}")
            continue
        sub = _dataclass_type(hints[key])
        if sub is not None and value is not None:
            kwargs[key] = _build(sub, value, path, errors)
        else:
            kwargs[key] = _coerce(value, hints[key], path, errors)
    return cls(**kwargs)


def parse_overrides(argv: list[str]) -> tuple[Optional[str], dict]:
    """`--config f.yaml --tp 2 --rollout.n 8` -> ('f.yaml', {'parallel': {'tp': 2}, 'rollout': {'n': 8}})."""
    config_path, nested, errors = None, {}, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            errors.append(f"unexpected argument {arg!r}; flags look like --tp 2 or --rollout.n 8")
            i += 1
            continue
        key, eq, inline = arg.partition("=")
        i += 1
        if not eq:
            if i < len(argv) and not argv[i].startswith("--"):
                inline, i = argv[i], i + 1
            else:
                inline = "true"  # a bare flag is a boolean switch: --sp
        if key == "--config":
            if not eq and inline == "true":  # a bare --config: the file name is missing, not a boolean
                errors.append("--config needs a YAML file: --config examples/tiny_cpu.yaml")
            config_path = inline
            continue
        if key == "--resume":  # bare: SAVE_DIR/latest; with a path: that checkpoint
            nested.setdefault("checkpoint", {})["resume"] = "latest" if inline == "true" else inline
            continue
        if key in ("--external-plugins", "--external_plugins"):  # ms-swift's flag: one file, or a comma list
            nested.setdefault("external_plugins", []).extend(p for p in inline.split(",") if p)
            continue
        dotted = SHORT_FLAGS.get(key, key[2:])
        if "." not in dotted:
            errors.append(f"unknown flag {key}; use --tp/--pp/--cp/--vpp/--ep/--sp or a dotted --section.key")
            continue
        node = nested
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):  # `--model.tiny --model.tiny.seed 3`: the dotted key wins
                node[part] = {}
            node = node[part]
        value = yaml.safe_load(inline)
        if dotted == "rollout.servers" and isinstance(value, str):  # --rollout.servers URL1,URL2
            value = [u for u in value.split(",") if u]
        if not (value is True and isinstance(node.get(parts[-1]), dict)):  # `--model.tiny` after --model.tiny.x
            node[parts[-1]] = value
    if errors:
        raise ConfigError(errors)
    return config_path, nested


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _tiny_only_for_its_path(cfg: Config, overrides: dict) -> None:
    """`model.tiny` writes a random model at `model.path` when the folder is missing. It applies only to the path
    named beside it: a `--model.path` flag over a YAML that names `model.tiny` turns it off (a typo must not
    become a random model), unless `--model.tiny` is given too."""
    flags = _user_sources({}, overrides, "model")
    if cfg.model.tiny is not None and "path" in flags and "tiny" not in flags:
        cfg.model.tiny = None


def _user_sources(data: dict, overrides: dict, section: str) -> dict:
    """{field: 'yaml' | 'flag'} for the fields of `section` the user set (a flag beats the YAML)."""
    out = {}
    for origin, tree in (("yaml", data), ("flag", overrides)):
        part = tree.get(section) if isinstance(tree, dict) else None
        if isinstance(part, dict):
            out.update({k: origin for k in part})
    return out


def _resolve_algorithm(cfg: Config, data: dict, overrides: dict) -> None:
    """Fill the preset's fields the user left unset; remember where every algorithm value came from."""
    from mgrpo.loss.presets import PRESETS, preset_values

    sources = {f.name: "default" for f in dataclasses.fields(AlgorithmConfig)}
    sources.update(_user_sources(data, overrides, "algorithm"))
    name = cfg.algorithm.loss_type
    if name in PRESETS:
        values = preset_values(name, {k for k, v in sources.items() if v != "default"})
        cfg.algorithm = dataclasses.replace(cfg.algorithm, **values)
        sources.update({k: f"preset {name}" for k in values})
    if cfg.algorithm.aggregation is None:  # the policy loss's own (GSPO: seq-mean-token-mean)
        from mgrpo.loss.policy import resolve_aggregation

        cfg.algorithm.aggregation = resolve_aggregation(cfg.algorithm.policy_loss)
        sources["aggregation"] = f"{cfg.algorithm.policy_loss}'s default"
    from mgrpo.rollout.producer import staleness_bound

    if staleness_bound(cfg.rollout) > 0 and sources["rollout_is_mode"] == "default":  # off-policy: correct it
        cfg.algorithm.rollout_is_mode = "token_truncate"
        sources["rollout_is_mode"] = f"rollout.mode={cfg.rollout.mode}"
    cfg._algorithm_sources = sources


def describe_algorithm(cfg: Config) -> str:
    """One line per algorithm field: its resolved value and where it came from (default, preset, yaml, flag)."""
    from mgrpo.loss.policy import resolve_epsilons

    a = cfg.algorithm
    sources = getattr(cfg, "_algorithm_sources", {})
    from mgrpo.loss.advantages import DEFAULT_SCALE_REWARDS

    eps = dict(zip(("epsilon_low", "epsilon_high"), resolve_epsilons(a.policy_loss, a.epsilon_low, a.epsilon_high)))
    eps["scale_rewards"] = DEFAULT_SCALE_REWARDS.get(a.advantage)
    lines = ["algorithm (value, from):"]
    for f in dataclasses.fields(a):
        value = getattr(a, f.name)
        note = ""
        if f.name in eps and value is None and eps[f.name] is not None:
            owner = a.advantage if f.name == "scale_rewards" else a.policy_loss
            value, note = eps[f.name], f" = {owner}'s default"
        lines.append(f"  {f.name:<22} {value!s:<24} ({sources.get(f.name, 'default')}{note})")
    if a.policy_loss == "sapo":
        lines.append(
            f"  source: sapo = Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347; "
            f"ms-swift loss_type sapo): gate sigmoid(tau (r - 1)) 4/tau, tau_pos {a.tau_pos}, "
            f"tau_neg {a.tau_neg}"
        )
    if a.top_entropy_quantile < 1:
        lines.append(
            f"  source: top_entropy_quantile = the top {a.top_entropy_quantile:g} of each mini-batch's "
            f"tokens by entropy train (Wang et al. 2025, arXiv:2506.01939; ms-swift --top_entropy_quantile)"
        )
    if a.loss_type:
        from mgrpo.loss.presets import preset_values

        for k, v in preset_values(a.loss_type).items():
            if getattr(a, k) != v and sources.get(k) in ("yaml", "flag"):
                lines.append(
                    f"  note: preset {a.loss_type} would set {k}={v}; the {sources[k]} value {getattr(a, k)} wins"
                )
    return "\n".join(lines)


def load_config(path: Optional[str] = None, argv: Optional[list[str]] = None, check_files: bool = True) -> Config:
    """YAML + flags -> validated Config. Raises ConfigError listing every problem.

    A `loss_type` preset fills only the algorithm fields the user did not set (in YAML or by a flag); the
    numbers are validated after that, on the values the run will use.
    """
    flag_path, overrides = parse_overrides(list(argv or []))
    path = flag_path or path
    data: dict = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError([f"--config {path!r}: file not found"])
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise ConfigError([f"{path}: invalid YAML ({exc})"]) from None
    errors: list[str] = []
    if overrides.get("model", {}).get("tiny") is True:  # bare --model.tiny: the YAML's tiny model at --model.path
        yaml_model = data.get("model") if isinstance(data, dict) else None
        overrides["model"]["tiny"] = dict((yaml_model or {}).get("tiny") or {})
    cfg = _build(Config, _merge(data, overrides), "", errors)
    if not errors and cfg.external_plugins:  # before validation: plugins add the names it checks
        from mgrpo.plugins import PluginError, load_plugins

        if isinstance(cfg.external_plugins, str):
            cfg.external_plugins = [cfg.external_plugins]
        try:
            load_plugins(cfg.external_plugins)
        except PluginError as exc:
            errors.append(str(exc))
    if not errors:
        _tiny_only_for_its_path(cfg, overrides)
        _resolve_algorithm(cfg, data if isinstance(data, dict) else {}, overrides)
        found = validate_config(cfg)
        errors += found if check_files else [x for x in found if not x.startswith(("data.path", "eval.path"))]
    if errors:
        raise ConfigError(errors)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
