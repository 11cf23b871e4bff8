"""TRL's GRPOTrainer on the work benchmarks/vs_trl.py gives mgrpo; runs in TRL's own venv (.peers/trl).

    .peers/trl/bin/python benchmarks/peers/trl_grpo.py --spec spec.json --out trl.json

The spec (written by vs_trl.py) names the model folder, the prompts file, the batch (prompts x n), the completion
length, the learning rate and the steps. The reward is mgrpo's `token_fraction` (the fraction of completion tokens
whose text is only digits), rewritten here on TRL's `completion_ids` so this venv needs nothing of mgrpo's.
Writes per-step wall time, the rollout (TRL's generate-and-score) time, completion tokens and mean reward, and
appends one line per finished step to the spec's `steps_file` (the benchmark's outside clock watches it, as it
watches mgrpo's metrics.jsonl). `"vllm": true` asks for TRL's colocated vLLM (`use_vllm`, `vllm_mode="colocate"`)."""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.load(open(args.spec))
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    digits = {t for t in range(len(tok)) if (s := tok.decode([t]).strip()) and all(c in "0123456789" for c in s)}

    def token_fraction(completion_ids, **_):
        return [sum(t in digits for t in ids) / len(ids) if ids else 0.0 for ids in completion_ids]

    rows = [json.loads(line) for line in open(spec["prompts"])]
    prompts = [r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}] for r in rows]
    data = Dataset.from_dict({"prompt": prompts})
    batch = spec["prompts_per_step"] * spec["n"]
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3) if spec.get("vllm") else {}
    config = GRPOConfig(
        **vllm,
        output_dir=spec["workdir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        logging_steps=1,
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=batch // spec["micro_batch_size"],
        num_generations=spec["n"],
        max_completion_length=spec["max_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        save_strategy="no",
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        max_grad_norm=1.0,
    )
    trainer = GRPOTrainer(
        model=spec["model"], reward_funcs=token_fraction, args=config, train_dataset=data, processing_class=tok
    )
    record = {"step_s": [], "rollout_s": [], "completion_tokens": [], "reward": []}
    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        started = time.perf_counter()
        out = generate(*a, **k)
        record["rollout_s"].append(time.perf_counter() - started)
        record["completion_tokens"].append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed_generate

    class Clock(TrainerCallback):
        """A step's wall clock: from its start to the next step's start (everything TRL's loop does between), the
        last one to its end; mgrpo's timing/step is its step's wall clock too."""

        started = None

        def on_step_begin(self, *_, **__):
            now = time.perf_counter()
            if self.started is not None:
                record["step_s"].append(now - self.started)
            self.started = now

        def on_step_end(self, *_, **__):  # one line per step: vs_trl.py's outside clock sees it arrive
            with open(spec["steps_file"], "a") as f:
                f.write(json.dumps({"step": len(record["rollout_s"])}) + "\n")

        def on_train_end(self, *_, **__):
            record["step_s"].append(time.perf_counter() - self.started)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                record["reward"].append(float(logs["reward"]))

    trainer.add_callback(Clock())
    trainer.train()
    json.dump(record, open(args.out, "w"))


if __name__ == "__main__":
    main()
