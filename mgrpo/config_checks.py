"""Field checks of the run configuration, one function per section; each message names the field and the fix."""

from __future__ import annotations

import difflib
import os

from mgrpo.config_mode_checks import (
    async_problems,
    colocate_problems,
    fast_path_problems,
    lora_problems,
    packing_problems,
)


def must(name: str, value, ok: bool, rule: str, fix: str = "") -> list:
    """[] when `ok`, else the one message for this field: "NAME=VALUE must be RULE; FIX"."""
    return [] if ok else [f"{name}={value!r} must be {rule}" + (f"; {fix}" if fix else "")]


def suggest(name: str, options) -> str:
    """The closest known name as a hint for a message (a name it begins, e.g. ppo -> ppo_clip, before a
    spelling neighbour), or the list of known ones."""
    options = list(options)
    prefixed = sorted(o for o in options if str(o).startswith(name + "_") or str(o).startswith(name + "-"))
    close = prefixed[:1] or difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(options))}"


def folder_problem(field: str, path: str) -> list:
    """A folder the run will create or write into: it, or a folder above it, must not be a regular file."""
    if not path:
        return []
    probe = os.path.abspath(path)
    while True:
        if os.path.isfile(probe):
            where = "is a file" if probe == os.path.abspath(path) else f"is under {probe}, which is a file"
            return [f"{field}={path!r} {where}, not a folder; choose another path"]
        parent = os.path.dirname(probe)
        if parent == probe or os.path.isdir(probe):
            return []
        probe = parent


def check_algorithm_names(a) -> list:
    from mgrpo.loss.kl import kl_estimator_names
    from mgrpo.loss.presets import AGGREGATIONS, PRESETS
    from mgrpo.loss.registry import ADVANTAGES, POLICY_LOSSES
    from mgrpo.loss.rollout_correction import ALIASES as IS_ALIASES
    from mgrpo.loss.rollout_correction import MODES as IS_MODES

    e = []
    checks = [
        ("loss_type", a.loss_type, list(PRESETS), True),
        ("advantage", a.advantage, ADVANTAGES.names(), False),
        ("policy_loss", a.policy_loss, POLICY_LOSSES.names(), False),
        ("aggregation", a.aggregation, list(AGGREGATIONS), True),
        ("kl_estimator", a.kl_estimator, kl_estimator_names(), False),
        ("rollout_is_mode", a.rollout_is_mode, list(IS_MODES) + list(IS_ALIASES), True),
    ]
    for name, value, known, nullable in checks:
        if (value is None and not nullable) or (value is not None and value not in known):
            e.append(f"algorithm.{name}={value!r} is unknown{suggest(str(value), known)}")
    return e


def check_vllm(r) -> list:
    import importlib.util

    v, e = r.vllm, []
    if importlib.util.find_spec("vllm") is None:
        e.append(
            "rollout.engine=vllm but the vllm package is not installed; run bash scripts/setup.sh (CPU) or "
            "pip install -e .[gpu], or use rollout.engine=hf"
        )
    if v.dtype not in ("auto", "float32", "bfloat16", "float16"):
        e.append(f"rollout.vllm.dtype={v.dtype!r}; use auto, float32, bfloat16 or float16")
    if v.update_ring is not None and (v.update_ring < 0 or v.update_ring == 1):
        e.append(f"rollout.vllm.update_ring={v.update_ring}; use 0 (stage the whole update) or >= 2")
    e += must(
        "rollout.vllm.gpu_memory_utilization",
        v.gpu_memory_utilization,
        0 < v.gpu_memory_utilization <= 1,
        "in (0, 1]",
        "the share of GPU memory vLLM may take, e.g. 0.5",
    )
    e += must("rollout.vllm.kv_cache_gb", v.kv_cache_gb, v.kv_cache_gb > 0, "> 0", "the CPU KV cache in GB, e.g. 1")
    e += must("rollout.vllm.tensor_parallel_size", v.tensor_parallel_size, v.tensor_parallel_size >= 1, ">= 1")
    if v.cpu_affinity is not None:
        import os

        cores = list(range(os.cpu_count() or 1))  # not this process's own affinity: taskset may have narrowed it
        given = v.cpu_affinity if isinstance(v.cpu_affinity, list) else [v.cpu_affinity]
        if not given or any(isinstance(c, bool) or not isinstance(c, int) or c not in cores for c in given):
            e.append(f"rollout.vllm.cpu_affinity={v.cpu_affinity!r}: a list of this machine's cores {cores}, or null")
    return e


def check_logging(g) -> list:
    import importlib.util

    e = folder_problem("logging.output_dir", g.output_dir)
    if g.completions_interval < 0:
        e.append(f"logging.completions_interval={g.completions_interval} must be >= 0 (0 = never)")
    if g.tensorboard and importlib.util.find_spec("tensorboard") is None:
        e.append(
            "logging.tensorboard=true but the tensorboard package is not installed; pip install tensorboard "
            "or set logging.tensorboard=false"
        )
    if g.wandb is not None:
        if g.wandb.mode not in (None, "online", "offline", "disabled"):
            e.append(f"logging.wandb.mode={g.wandb.mode!r}; use online, offline, disabled or null")
        if importlib.util.find_spec("wandb") is None:
            e.append(
                "logging.wandb is set but the wandb package is not installed; pip install wandb or remove logging.wandb"
            )
        elif (
            g.wandb.mode in (None, "online")
            and os.environ.get("WANDB_MODE") not in ("offline", "disabled")
            and not wandb_key_present()
        ):
            e.append(
                "logging.wandb logs online but no wandb API key was found (WANDB_API_KEY or `wandb login`); "
                "set --logging.wandb.mode offline to log locally without one (upload later: wandb sync "
                "OUTPUT_DIR/wandb/offline-run-*)"
            )
    return e


def wandb_key_present() -> bool:
    """WANDB_API_KEY, or a key `wandb login` stored in ~/.netrc (or $NETRC)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        hosts = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc")).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def check_remote(r) -> list:
    """rollout.engine: remote: where the servers are and how long to wait for them."""
    e = []
    servers = r.servers.split(",") if isinstance(r.servers, str) else list(r.servers or [])
    r.servers = [s.strip() for s in servers if s and s.strip()]
    if not r.servers:
        e.append(
            f"rollout.engine={r.engine} needs rollout.servers: the rollout servers' URLs, e.g. --rollout.servers "
            "http://10.0.0.5:8000,http://10.0.0.6:8000 (start each with launch/rollout_server.py)"
        )
    from mgrpo.netutil import is_loopback_url

    m = r.remote
    for url in r.servers:
        if not url.startswith(("http://", "https://")):
            e.append(f"rollout.servers: {url!r} is not an http:// or https:// URL")
        elif url.startswith("http://") and not m.allow_plain_http and not is_loopback_url(url):
            e.append(
                f"rollout.servers: {url!r} is plain http to another host: the token would travel in clear; "
                f"serve TLS and use https://, or set rollout.remote.allow_plain_http=true on a trusted network"
            )
    e += must(
        "rollout.remote.max_consecutive_failures", m.max_consecutive_failures, m.max_consecutive_failures >= 1, ">= 1"
    )
    if m.checksum not in ("xxh3_128", "sha256"):
        e.append(f"rollout.remote.checksum={m.checksum!r}; use xxh3_128 (fast, catches corruption) or sha256")
    if r.engine_placement == "per_dp":
        e.append(
            f"rollout.engine={r.engine} with rollout.engine_placement=per_dp would have every DP leader push the "
            "same versions to every server; use rollout.engine_placement=rank0 (remote engines are not yet "
            "partitioned per DP group)"
        )
    for name in ("connect_timeout_s", "request_timeout_s", "backoff_s", "update_timeout_s"):
        if getattr(m, name) <= 0:
            e.append(f"rollout.remote.{name}={getattr(m, name)} must be > 0 seconds")
    if m.transport == "auto":
        m.transport = "collective" if r.engine == "sglang" else "http"
    if m.transport not in ("http", "collective"):
        e.append(
            f"rollout.remote.transport={m.transport!r}; use auto, http or collective (vLLM servers: start "
            f"them with --transport collective)"
        )
    e += must("rollout.remote.full_every", m.full_every, m.full_every >= 0, ">= 0 (0: full only when needed)")
    if m.delta and r.engine == "sglang":
        e.append(
            "rollout.remote.delta=true with rollout.engine=sglang: SGLang's weight receiver takes whole tensors "
            "only; set rollout.remote.delta=false"
        )
    if r.engine == "sglang" and m.transport != "collective":
        e.append(
            f"rollout.engine=sglang with rollout.remote.transport={m.transport!r}: SGLang servers take weights "
            f"by collective broadcast only; set rollout.remote.transport: collective"
        )
    if m.run_id and not (len(m.run_id) <= 64 and m.run_id.isascii() and m.run_id.isprintable()):
        e.append(f'rollout.remote.run_id={m.run_id!r}: at most 64 printable ASCII characters (or "" for a random one)')
    e += must("rollout.remote.retries", m.retries, m.retries >= 0, ">= 0", "0 = never retry a request")
    e += must(
        "rollout.remote.max_inflight_per_server", m.max_inflight_per_server, m.max_inflight_per_server >= 1, ">= 1"
    )
    return e


def check_checkpoint(c) -> list:
    e = []
    e += must("checkpoint.save_interval", c.save_interval, c.save_interval >= 0, ">= 0", "0 = never save")
    e += must("checkpoint.keep_last", c.keep_last, c.keep_last >= 0, ">= 0", "0 = keep all")
    if (c.save_interval or c.export_hf_at_end) and not c.save_dir:
        e.append(
            "checkpoint.save_interval or checkpoint.export_hf_at_end is set but checkpoint.save_dir is empty; "
            "give a folder for the checkpoints"
        )
    e += folder_problem("checkpoint.save_dir", c.save_dir)
    if c.resume in ("latest", "auto") and not c.save_dir:
        e.append(
            f"--resume ({c.resume}) needs checkpoint.save_dir, the folder that holds `latest`; or give the "
            "checkpoint: --resume SAVE_DIR/step_XXXXXX"
        )
    return e


def check_algorithm_numbers(a) -> list:
    """Ranges of the resolved algorithm values; each message names the field and the fix."""
    from mgrpo.loss.policy import resolve_epsilons

    e = []
    low, high = resolve_epsilons(a.policy_loss, a.epsilon_low, a.epsilon_high)
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1:
        e.append(
            f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (the dual clip caps the loss at -A x c where "
            f"A < 0); use e.g. 3.0 (verl's value) or null to turn it off"
        )
    if a.policy_loss == "cispo":
        if high is None or high <= 1:
            e.append(
                f"algorithm.epsilon_high={high} is CISPO's absolute cap on the ratio and must be > 1; use e.g. "
                f"5.0 (or null for the default 5.0)"
            )
    else:
        if low is not None and not 0 <= low < 1:
            e.append(
                f"algorithm.epsilon_low={low} must be in [0, 1) (the ratio is clipped below at 1 - "
                f"epsilon_low); use e.g. 0.2"
            )
        if high is not None and high <= 0:
            e.append(
                f"algorithm.epsilon_high={high} must be > 0 (the ratio is clipped above at 1 + epsilon_high); "
                f"use e.g. 0.2 or 0.28"
            )
    e += must(
        "algorithm.tau_pos",
        a.tau_pos,
        a.tau_pos > 0,
        "> 0 (SAPO's gate temperature where A > 0)",
        "the paper's default is 1.0",
    )
    e += must(
        "algorithm.tau_neg",
        a.tau_neg,
        a.tau_neg > 0,
        "> 0 (SAPO's gate temperature where A < 0)",
        "the paper's default is 1.05",
    )
    e += must(
        "algorithm.top_entropy_quantile",
        a.top_entropy_quantile,
        0 < a.top_entropy_quantile <= 1,
        "in (0, 1]",
        "the share of highest-entropy tokens that train, e.g. 0.2; 1.0 = off",
    )
    if a.kl_coef < 0:
        e.append(
            f"algorithm.kl_coef={a.kl_coef} must be >= 0 (a negative coefficient rewards moving away from the "
            f"reference); use 0 to turn KL off"
        )
    if a.rollout_is_threshold <= 0:
        e.append(f"algorithm.rollout_is_threshold={a.rollout_is_threshold} must be > 0; use e.g. 2.0")
    elif a.rollout_is_lower is not None and not 0 <= a.rollout_is_lower < a.rollout_is_threshold:
        e.append(
            f"algorithm.rollout_is_lower={a.rollout_is_lower} must be >= 0 and below rollout_is_threshold="
            f"{a.rollout_is_threshold}; use e.g. 0.5 or null for no lower bound"
        )
    return e


def _check_path(value: str, name: str) -> list:
    if "/path/to/" in value and not os.path.exists(value):
        return [
            f"{name}={value!r} is the example's placeholder: make a .jsonl with a prompt column (and solution, for "
            f"the accuracy reward; examples/gsm8k.yaml's header makes one from GSM8K in one command) and pass "
            f"--{name} FILE"
        ]
    if not os.path.exists(value):
        return [f"{name}={value!r}: not found; check the path (relative paths are from {os.getcwd()})"]
    return []


def check_data(d) -> list:
    if not d.path:
        return ["data.path is empty; give a .jsonl, .json or .parquet file or a save_to_disk folder"]
    e = _check_path(d.path, "data.path")
    if d.max_prompt_length is not None and d.max_prompt_length < 1:
        e.append(f"data.max_prompt_length={d.max_prompt_length} must be >= 1 tokens, or null to keep every prompt")
    return e


def check_eval(cfg) -> list:
    v, e = cfg.eval, []
    if v.interval < 0:
        e.append(f"eval.interval={v.interval} must be >= 0 (0 = no validation)")
    if v.interval == 0:
        return e
    e += (
        ["eval.path is empty; give a held-out prompt file or set eval.interval=0"]
        if not v.path
        else _check_path(v.path, "eval.path")
    )
    if v.n < 1:
        e.append(f"eval.n={v.n} must be >= 1")
    e += must("eval.temperature", v.temperature, v.temperature >= 0, ">= 0", "0 = greedy")
    e += must("eval.top_p", v.top_p, 0 < v.top_p <= 1, "in (0, 1]", "1.0 = off")
    if v.temperature == 0 and v.n > 1:
        e.append(f"eval.n={v.n} greedy samples would all be the same; set eval.temperature > 0 or eval.n=1")
    if v.max_tokens is not None and v.max_tokens < 1:
        e.append(f"eval.max_tokens={v.max_tokens} must be >= 1 or null (rollout.max_tokens)")
    bad = [k for k in v.k if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= v.n]
    if bad:
        e.append(f"eval.k={v.k}: each k must be an integer in [1, eval.n={v.n}]; raise eval.n or drop {bad}")
    if v.pass_reward is not None and v.pass_reward not in cfg.reward.funcs:
        e.append(
            f"eval.pass_reward={v.pass_reward!r} is not one of reward.funcs {cfg.reward.funcs}; name one of "
            f"them or use null (the weighted total)"
        )
    return e


def check_sampling(a) -> list:
    if a.max_resample_times < 0:
        return [f"algorithm.max_resample_times={a.max_resample_times} must be >= 0"]
    return []


def check_scheduler(r) -> list:
    from mgrpo.rollout.multiturn.registry import multi_turns, scheduler_names

    e = []
    if r.scheduler is not None and r.scheduler not in scheduler_names():
        e.append(
            f"rollout.scheduler={r.scheduler!r} is unknown{suggest(str(r.scheduler), list(multi_turns))}; "
            f"known: {', '.join(scheduler_names())} (or null for single-turn batches)"
        )
    if not isinstance(r.scheduler_kwargs, dict):
        e.append(
            f"rollout.scheduler_kwargs must be a mapping, e.g. {{gym_env: guess_number}}; got "
            f"{type(r.scheduler_kwargs).__name__}"
        )
    if r.max_turns is not None and r.max_turns < 1:
        e.append(f"rollout.max_turns={r.max_turns} must be >= 1 or null (until the scheduler stops)")
    if r.max_concurrent < 1:
        e.append(f"rollout.max_concurrent={r.max_concurrent} must be >= 1")
    if r.max_total_tokens is not None and r.max_total_tokens < 2:
        e.append(f"rollout.max_total_tokens={r.max_total_tokens} must be >= 2 or null (the engine's context)")
    return e


def check_rewards(rw) -> list:
    from mgrpo.rewards.registry import reward_names

    e = []
    known = reward_names()
    for name in rw.funcs or []:
        if name not in known:
            e.append(
                f"reward.funcs: {name!r} is not a registered reward{suggest(str(name), known)}; known: "
                f"{', '.join(known)} (plugins: --external-plugins path/to/plugin.py)"
            )
    if not rw.funcs:
        e.append("reward.funcs is empty; name at least one reward, e.g. [accuracy]")
    if rw.weights is not None and len(rw.weights) != len(rw.funcs or []):
        e.append(
            f"reward.weights has {len(rw.weights)} entries for {len(rw.funcs or [])} reward.funcs; give one "
            f"weight per function or null (all 1)"
        )
    e += must("reward.timeout_s", rw.timeout_s, rw.timeout_s > 0, "> 0 seconds")
    e += must("reward.workers", rw.workers, rw.workers >= 1, ">= 1")
    return e


def check_length_rewards(cfg) -> list:
    """soft_overlong needs its cache length, and a length limit the response can be measured against."""
    from mgrpo.rewards.registry import response_token_budget

    kw = cfg.reward.kwargs if isinstance(cfg.reward.kwargs, dict) else {}
    if "soft_overlong" not in (cfg.reward.funcs or []):
        return []
    e = []
    cache, limit = kw.get("soft_cache_length") or 0, kw.get("soft_max_length") or response_token_budget(cfg.rollout)
    if not isinstance(cache, (int, float)) or cache <= 0:
        e.append(
            f"reward.kwargs.soft_cache_length={cache!r}: soft_overlong needs a cache length > 0 (DAPO's "
            f"L_cache, e.g. 4096 tokens)"
        )
    if not limit:
        e.append(
            f"reward.kwargs.soft_max_length is unset and rollout.scheduler={cfg.rollout.scheduler} has no "
            f"rollout.max_turns: soft_overlong measures a whole trajectory's model tokens, so give it "
            f"soft_max_length (DAPO's L_max over all turns) or set rollout.max_turns"
        )
    elif isinstance(cache, (int, float)) and cache >= limit:
        e.append(
            f"reward.kwargs.soft_cache_length={cache} must be below the limit {limit} (soft_max_length or the "
            f"response's token budget)"
        )
    return e


def validate_config(cfg) -> list[str]:
    """Every check that needs no model and no process group (config.load_config runs it; layout_checks.py has
    those against the model; config_mode_checks.py those of the modes that span sections)."""
    e = fast_path_problems(cfg)
    p, r, a, t = cfg.parallel, cfg.rollout, cfg.algorithm, cfg.train
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) < 1:
            e.append(f"parallel.{name}={getattr(p, name)} must be >= 1")
    if p.vpp is not None and p.vpp < 1:
        e.append(f"parallel.vpp={p.vpp} must be >= 1 or null")
    if p.vpp and p.vpp > 1 and p.pp < 2:
        e.append(f"parallel.vpp={p.vpp} needs parallel.pp >= 2; set --pp or drop --vpp")
    if p.sp and p.tp < 2:
        e.append("parallel.sp=true needs parallel.tp >= 2; set --tp 2 or --sp false")
    w = cfg.model.tiny.warm_start if cfg.model.tiny else None
    if w is not None:
        e += must("model.tiny.warm_start.task", w.task, w.task == "addition", "addition (the one warm-start task)")
        e += must("model.tiny.warm_start.steps", w.steps, w.steps >= 1, ">= 1")
        e += must("model.tiny.warm_start.low", w.low, 0 <= w.low <= w.high, "in [0, model.tiny.warm_start.high]")
    if not cfg.model.path:
        e.append("model.path is empty; give an HF model folder (or model.tiny with a path to write it to)")
    if cfg.model.params_dtype not in ("float32", "bfloat16"):
        e.append(f"model.params_dtype={cfg.model.params_dtype!r}; use float32 or bfloat16")
    from mgrpo.rollout.engine import engine_names

    if r.engine not in engine_names():
        e.append(f"rollout.engine={r.engine!r} is not available in this build; use one of: {', '.join(engine_names())}")
    if r.engine == "vllm":
        e += check_vllm(r)
    if r.engine in ("remote", "sglang"):
        e += check_remote(r)
    e += check_scheduler(r) + check_rewards(cfg.reward) + check_length_rewards(cfg)
    if r.engine_placement not in ("rank0", "per_dp"):
        e.append(f"rollout.engine_placement={r.engine_placement!r}; use rank0 or per_dp")
    if r.request_timeout_s <= 0:
        e.append(f"rollout.request_timeout_s={r.request_timeout_s} must be > 0 seconds")
    for name in ("n", "prompts_per_step", "max_tokens", "max_num_seqs", "max_inflight"):
        if getattr(r, name) < 1:
            e.append(f"rollout.{name}={getattr(r, name)} must be >= 1")
    if not 0 < r.top_p <= 1:
        e.append(f"rollout.top_p={r.top_p} must be in (0, 1]; use 1.0 to turn it off")
    if r.top_k < 0:
        e.append(f"rollout.top_k={r.top_k} must be >= 0; use 0 to turn it off")
    if r.temperature <= 0:
        e.append(f"rollout.temperature={r.temperature} must be > 0 (the trainer divides logits by it)")
    if a.scale_rewards not in (None, "group", "batch", "none"):
        e.append(f"algorithm.scale_rewards={a.scale_rewards!r}; use group, batch, none or null")
    names = check_algorithm_names(a)
    e += names or check_algorithm_numbers(a)
    e += check_sampling(a)
    for name in ("steps", "micro_batch_size", "steps_per_generation", "num_iterations"):
        e += must(f"train.{name}", getattr(t, name), getattr(t, name) >= 1, ">= 1")
    if t.steps_per_generation >= 1 and r.prompts_per_step * r.n % t.steps_per_generation:
        e.append(
            f"rollout.prompts_per_step x rollout.n = {r.prompts_per_step * r.n} is not divisible by "
            f"train.steps_per_generation={t.steps_per_generation}; choose a divisor"
        )
    if t.lr_schedule not in ("constant", "linear", "cosine"):
        e.append(f"train.lr_schedule={t.lr_schedule!r}; use constant, linear or cosine")
    e += must("train.lr", t.lr, t.lr > 0, "> 0", "the peak learning rate, e.g. 1e-6")
    e += must("train.warmup_steps", t.warmup_steps, t.warmup_steps >= 0, ">= 0", "0 = no warmup")
    if t.lr > 0:
        e += must(
            "train.min_lr",
            t.min_lr,
            0 <= t.min_lr <= t.lr,
            f"in [0, train.lr={t.lr}]",
            "the LR the schedule decays to, e.g. 0",
        )
    e += check_logging(cfg.logging) + check_eval(cfg) + check_data(cfg.data) + check_checkpoint(cfg.checkpoint)
    e += async_problems(cfg) + lora_problems(cfg) + packing_problems(cfg) + colocate_problems(cfg)
    return e
