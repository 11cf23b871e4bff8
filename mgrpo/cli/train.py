"""Train a policy with GRPO.

    mgrpo-train --config examples/tiny_cpu.yaml
    torchrun --nproc-per-node 4 launch/train_grpo.py --config examples/tiny_cpu.yaml --tp 2 --pp 2
    mgrpo-train --config examples/qwen72b.yaml --tp 8 --pp 2 --print-plan --world-size 16

(`python launch/train_grpo.py` is the same command from a checkout; torchrun takes that file, or `-m mgrpo.cli.train`.)

Every config, model and dataset error is reported (one line each) before any process group starts.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

# megatron-core warns at import about every optional kernel package it does not find (Apex, TE, ...)
warnings.filterwarnings("ignore", module=r"megatron\.")

from mgrpo.parallel.omp import choose_wait_policy  # noqa: E402

choose_wait_policy()  # before torch is imported (libgomp reads it once)

from mgrpo.cli.dialect import trainer_flags  # noqa: E402
from mgrpo.config import ConfigError, describe_algorithm, load_config  # noqa: E402
from mgrpo.data.dataset import DatasetError, load_run_data  # noqa: E402
from mgrpo.layout_checks import validate_layout  # noqa: E402
from mgrpo.models.hf_config import ModelConfigError, read_model_info  # noqa: E402
from mgrpo.parallel.distributed import read_dist_env  # noqa: E402
from mgrpo.plan import take_plan_flags  # noqa: E402
from mgrpo.stopping import EXIT_INTERRUPTED, handle_ctrl_c  # noqa: E402


def prepare_tiny_model(cfg, rank: int) -> None:
    """Rank 0 writes the embedded tiny model once (atomically) and warm-starts it if asked; other ranks wait."""
    path, tiny = cfg.model.path, cfg.model.tiny
    if tiny is None:
        return
    w = tiny.warm_start
    made = lambda: os.path.isfile(os.path.join(path, "config.json"))  # noqa: E731
    ready = lambda: made() and (w is None or os.path.isfile(os.path.join(path, "mgrpo_warm_start.json")))  # noqa: E731
    if ready():
        return
    if rank == 0:
        from dataclasses import asdict

        from mgrpo.models.tiny import make_tiny_hf

        if not made():  # the first line the run prints: a folder outside the output folder may be written here
            print(
                f"mgrpo: model.path={path} has no model: writing a random tiny {tiny.family} model there (model.tiny)",
                flush=True,
            )
            t = asdict(tiny)
            make_tiny_hf(
                path,
                family=t["family"],
                vocab_size=t["vocab_size"],
                hidden_size=t["hidden_size"],
                num_layers=t["num_layers"],
                num_heads=t["num_heads"],
                num_kv_heads=t["num_kv_heads"],
                ffn_hidden_size=t["ffn_hidden_size"],
                tie_word_embeddings=t["tie_word_embeddings"],
                seed=t["seed"],
                num_experts=t["num_experts"],
                experts_per_token=t["experts_per_token"],
                moe_ffn_hidden_size=t["moe_ffn_hidden_size"],
                initializer_range=t["initializer_range"],
            )
        if w is not None:
            from mgrpo.cli.warm_start import held_out_pairs, warm_start

            out = warm_start(path, w.steps, held_out_pairs(cfg.eval.path), w.low, w.high, w.batch_size, w.lr, w.seed)
            print(
                f"mgrpo: warm start: {out['steps']} steps of addition SFT in {out['seconds']:.1f} s, final loss "
                f"{out['loss']:.3f} (validation problems left out)",
                flush=True,
            )
        return
    deadline = time.time() + 600
    while not ready():
        if time.time() > deadline:
            raise ModelConfigError(f"{path}: rank 0 did not finish writing the tiny model within 600 s")
        time.sleep(0.5)


def check(argv: list):
    """Everything that can be wrong before a process group exists; raises with every problem. Returns the config,
    the launch environment and the loaded (training, held-out) prompts."""
    import torch

    from mgrpo.data.tokenizer import load_tokenizer

    cfg = load_config(argv=argv)
    from mgrpo.run_logger import reused_output_problem

    if reused_output_problem(cfg):
        raise ConfigError(reused_output_problem(cfg))
    denv = read_dist_env()
    prepare_tiny_model(cfg, denv.rank)
    info = read_model_info(cfg.model.path)
    if not torch.cuda.is_available():
        from mgrpo.plan import cpu_memory_problem

        problem = cpu_memory_problem(cfg, info, int(os.environ.get("LOCAL_WORLD_SIZE", denv.world_size)))
        if problem:
            raise ConfigError([problem])
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(cfg.model.path)):
        raise ModelConfigError(
            f"model.path={cfg.model.path!r} holds config.json but no weights (*.safetensors); "
            f"point --model.path at the downloaded model folder"
        )
    errors = validate_layout(cfg, info, denv.world_size, torch.cuda.is_available())
    if errors:
        raise ConfigError(errors)
    if cfg.checkpoint.resume:  # a complete checkpoint of this model, and a run that may continue it
        from mgrpo.resume import check_resume

        notes = check_resume(cfg)
        if not cfg.checkpoint.resume and denv.rank == 0:  # --resume auto with nothing saved yet
            print("\n".join(notes), flush=True)
    data = load_run_data(cfg, load_tokenizer(cfg.model.path), progress=denv.rank == 0)
    return cfg, denv, data


def main(argv: list | None = None) -> int:
    from mgrpo.resume import ResumeError  # imported here: worker processes spawned later re-import this module

    handle_ctrl_c()  # one Ctrl-C: a clean stop, exit 130; two: exit 130 at once
    argv = trainer_flags(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        from mgrpo.cli.help import config_help

        try:
            print(config_help(), flush=True)
        except BrokenPipeError:  # `mgrpo-train --help | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    try:
        argv, plan = take_plan_flags(argv)
        if plan["print"]:  # the layout, parameters and memory per rank of this launch; no weights, no GPU
            from mgrpo.plan import print_plan

            print_plan(argv, plan["world"], plan["attention"], plan["gpu"])
            return 0
        cfg, denv, data = check(argv)
    except (ConfigError, ModelConfigError, DatasetError, ResumeError) as exc:
        if read_dist_env().rank == 0:
            lines = str(exc).splitlines()
            print(
                "\n".join(line if line.startswith("config error") else f"error: {line}" for line in lines),
                file=sys.stderr,
            )
        return 2
    if denv.rank == 0:
        print(describe_algorithm(cfg), flush=True)
    import torch.distributed as dist

    from mgrpo.parallel.distributed import shutdown_distributed

    owns_group = not dist.is_initialized()  # a caller's own group (tests call main in-process) is left alone
    try:
        return train(cfg, denv, data)
    finally:  # under nccl a group never destroyed ends stderr with torch's warning, hiding the error above it
        if owns_group:
            shutdown_distributed()


def train(cfg, denv, data) -> int:
    from mgrpo.checkpoint import CheckpointFolderError
    from mgrpo.rollout.manager import RolloutError
    from mgrpo.trainer import GRPOTrainer
    from mgrpo.weights.load import CheckpointError

    try:
        trainer = GRPOTrainer(cfg, data)
    except (CheckpointError, CheckpointFolderError) as exc:  # a missing or damaged shard, found while loading
        if denv.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except RolloutError as exc:  # an engine did not start: every rank stops, rank 0 says why
        if denv.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 1

    try:
        history = trainer.fit()
    except RolloutError as exc:  # an engine timed out, failed or refused a weight update: all ranks stop
        if denv.rank == 0 and not getattr(exc, "reported", False):
            print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C (mgrpo/stopping.py): fit() closed the logs, the saver and the engines
        if denv.rank == 0:
            done = trainer.start_step + trainer.log.steps_logged
            print(
                f"mgrpo: stopped by Ctrl-C after {done} complete step(s) (metrics in "
                f"{os.path.join(cfg.logging.output_dir, 'metrics.jsonl')}); "
                + ("continue with --resume" if cfg.checkpoint.save_dir else "no checkpoint.save_dir to resume from"),
                file=sys.stderr,
                flush=True,
            )
        return EXIT_INTERRUPTED
    if denv.rank == 0 and history:
        k = min(5, len(history))
        first = sum(h["reward/mean"] for h in history[:k]) / k
        last = sum(h["reward/mean"] for h in history[-k:]) / k
        print(
            f"reward/mean first{k}={first:.4f} last{k}={last:.4f} "
            f"metrics={os.path.join(cfg.logging.output_dir, 'metrics.jsonl')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
