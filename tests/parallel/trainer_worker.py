"""torchrun worker: GRPOTrainer.step itself (not the layout harness) for several layouts and configurations in one
launch; rank 0 saves every optimizer step's loss and grad norm and the weights the engine received after it."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from mgrpo.parallel.omp import choose_wait_policy  # noqa: E402

choose_wait_policy()  # as the launcher does, before torch

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mgrpo.config import load_config  # noqa: E402
from mgrpo.parallel.distributed import init_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    "a": [
        "--algorithm.kl_coef",
        "0.05",
        "--algorithm.kl_estimator",
        "k3",
        "--algorithm.entropy_coef",
        "0.01",
        "--algorithm.rollout_is_mode",
        "tis",
    ],
    "b": ["--algorithm.kl_coef", "0.05", "--algorithm.kl_in_reward", "true"],
}
LAYOUTS = {
    "tp1": [],
    "dp2": [],
    "cp2": ["--cp", "2"],
    "tp2-pp2-dp2": ["--tp", "2", "--pp", "2"],
    "tp2-pp2": ["--tp", "2", "--pp", "2"],
}


def config(model: str, out: str, layout: str, name: str):
    return load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(ROOT, "examples", "data", "tiny_prompts.jsonl"),
            "--logging.output_dir",
            os.path.join(out, f"run-{layout}-{name}"),
            "--logging.progress_bar",
            "false",
            "--logging.report",
            "false",
            "--logging.tensorboard",
            "false",
            "--logging.completions_interval",
            "0",
            "--rollout.prompts_per_step",
            "4",
            "--rollout.n",
            "4",
            "--rollout.max_tokens",
            "16",
            "--train.micro_batch_size",
            "2",
            "--train.steps_per_generation",
            "2",
            "--train.steps",
            "1",
            "--train.lr",
            "0.01",
            "--train.adam_eps",
            "0.001",  # eps 1e-3: Adam does not amplify rounding
            *LAYOUTS[layout],
            *CONFIGS[name],
        ],
    )


def run(model: str, out: str, layout: str, name: str) -> None:
    from mgrpo.trainer import GRPOTrainer

    cfg = config(model, out, layout, name)
    cfg.model.tiny = None
    trainer = GRPOTrainer(cfg)
    metrics = trainer.step(0)
    if dist.get_rank() == 0:
        result = {
            "updates": [
                {k: u[k] for k in ("actor/loss", "actor/grad_norm", "actor/kl_old", "actor/clip_frac")}
                for u in trainer.update_metrics
            ],
            "reward": metrics["reward/mean"],
            "kl_ref": metrics.get("actor/kl_ref"),
        }
        with open(os.path.join(out, f"{layout}-{name}.json"), "w") as f:
            json.dump(result, f)
        torch.save(
            {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()},
            os.path.join(out, f"{layout}-{name}.pt"),
        )
    trainer.log.close()
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", required=True, help="layout:config,... e.g. dp2:a,dp2:b")
    args = ap.parse_args()
    init_distributed()
    for spec in args.runs.split(","):
        layout, name = spec.split(":")
        run(args.model, args.out, layout, name)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
