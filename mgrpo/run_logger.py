"""Where a run's numbers go: metrics.jsonl, TensorBoard, wandb (the same flat dict in every sink), a progress
bar, completions.jsonl, config.yaml at the start and report.png at the end. Only the rank that holds the
metrics (global rank 0) writes; the others get a disabled logger."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

import yaml
from tqdm import tqdm

SHOWN = {"reward/mean": "reward", "actor/kl_old": "kl_old", "actor/clip_frac": "clip", "perf/tokens_per_s": "tok/s"}


def cut_back(path: str, first_step: int) -> None:
    """Keep only the rows of steps before `first_step` (a resumed run appends the rest): tmp file, then rename."""
    if not os.path.isfile(path):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(path) as src, open(tmp, "w") as dst:
        for line in src:
            try:
                keep = json.loads(line).get("step", -1) < first_step
            except ValueError:  # a line cut short by the kill
                keep = False
            if keep:
                dst.write(line if line.endswith("\n") else line + "\n")
    os.replace(tmp, path)


class JsonlSink:
    def __init__(self, output_dir: str, resume_step: int = 0):
        path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step:
            cut_back(path, resume_step)
        self.file = open(path, "a" if resume_step else "w")

    def write(self, step: int, metrics: dict) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars through the tensorboard package's own event-file writer (no TensorFlow, no torch wrapper)."""

    def __init__(self, output_dir: str, resume_step: int = 0):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(os.path.join(output_dir, "tensorboard"))
        if resume_step:  # TensorBoard hides the earlier files' events from this step on (torch's purge_step)
            self.writer.add_event(
                Event(step=resume_step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START))
            )

    def write(self, step: int, metrics: dict) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [
            Summary.Value(tag=k, simple_value=float(v))
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run in OUTPUT_DIR/wandb; `mode: offline` writes it locally with no network."""

    def __init__(self, output_dir: str, wcfg, config: dict, resume_step: int = 0):
        import wandb

        id_file = os.path.join(output_dir, "wandb", "mgrpo_run_id")
        run_id = open(id_file).read().strip() if resume_step and os.path.isfile(id_file) else None
        self.run = wandb.init(
            project=wcfg.project,
            name=wcfg.name,
            mode=wcfg.mode,
            dir=output_dir,
            config=config,
            reinit="finish_previous",
            id=run_id,
            resume="allow" if run_id else None,
        )
        os.makedirs(os.path.dirname(id_file), exist_ok=True)
        with open(id_file, "w") as f:  # a resumed run continues this wandb run
            f.write(self.run.id)

    def write(self, step: int, metrics: dict) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


RUN_FILES = ("metrics.jsonl", "completions.jsonl", "config.yaml", "report.png", "tensorboard", "wandb")


def earlier_run(output_dir: str) -> list:
    """The files of a run already in `output_dir` (a new run there would mix with them: TensorBoard overlays
    event files, wandb keeps its id)."""
    return [n for n in RUN_FILES if os.path.exists(os.path.join(output_dir, n))]


def reused_output_problem(cfg) -> list:
    """A fresh run into a folder that holds one: refused unless logging.overwrite (or --resume continues it)."""
    found = earlier_run(cfg.logging.output_dir) if not cfg.checkpoint.resume else []
    if not found or cfg.logging.overwrite:
        return []
    return [
        f"logging.output_dir={cfg.logging.output_dir!r} already holds a run ({', '.join(found)}); choose a new "
        f"folder, continue that run with --resume, or pass --logging.overwrite true to remove its files first"
    ]


def warnings_above_bar():
    """mgrpo's log records (warnings and up) printed above the progress bar, not into it: tqdm's own
    `logging_redirect_tqdm` on the "mgrpo" logger, with the logger's name in each line. A context manager,
    entered here; RunLogger.close leaves it. A second run logger in the same process (one not closed yet) adds
    no second handler: each warning prints once."""
    import contextlib

    from tqdm.contrib.logging import _TqdmLoggingHandler, logging_redirect_tqdm

    logger = logging.getLogger("mgrpo")
    if any(isinstance(h, _TqdmLoggingHandler) for h in logger.handlers):
        return contextlib.nullcontext()
    redirect = logging_redirect_tqdm(loggers=[logger])
    redirect.__enter__()
    for handler in logger.handlers:
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    return redirect


class RunLogger:
    def __init__(self, cfg, enabled: bool = True, resume_step: int = 0):
        """`resume_step`: the first step of a resumed run; the files are cut back to the steps before it. A fresh
        run with logging.overwrite removes an earlier run's files from the folder first."""
        from dataclasses import asdict as to_dict  # the config's dataclasses, as mgrpo.config.to_dict does

        g = cfg.logging
        self.enabled, self.cfg, self.dir, self.steps_logged = enabled, cfg, g.output_dir, 0
        if not enabled:
            return
        if g.overwrite and not resume_step:
            import shutil

            for name in earlier_run(self.dir):
                path = os.path.join(self.dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.makedirs(self.dir, exist_ok=True)
        tmp = os.path.join(self.dir, ".config.yaml.tmp")
        with open(tmp, "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        os.replace(tmp, os.path.join(self.dir, "config.yaml"))
        self.sinks = [JsonlSink(self.dir, resume_step)]
        if g.tensorboard:
            self.sinks.append(TensorBoardSink(self.dir, resume_step))
        if g.wandb is not None:
            self.sinks.append(WandbSink(self.dir, g.wandb, to_dict(cfg), resume_step))
        completions = os.path.join(self.dir, "completions.jsonl")
        if resume_step:
            cut_back(completions, resume_step)
        self.completions = open(completions, "a" if resume_step else "w") if g.completions_interval else None
        outputs = (
            ["metrics.jsonl", "config.yaml"]
            + (["completions.jsonl"] if self.completions else [])
            + (["report.png"] if g.report else [])
            + (["tensorboard/"] if g.tensorboard else [])
            + (["wandb/"] if g.wandb is not None else [])
        )
        print(f"mgrpo: outputs go to {os.path.abspath(self.dir)}: {', '.join(outputs)}", file=sys.stderr, flush=True)
        self.bar = tqdm(
            total=cfg.train.steps,
            initial=resume_step,
            desc="grpo",
            unit="step",
            dynamic_ncols=True,
            disable=not g.progress_bar,
        )
        self._warnings_above_bar = warnings_above_bar()

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        for sink in self.sinks:
            sink.write(step, metrics)
        self.steps_logged += 1
        self.bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in SHOWN.items() if k in metrics})
        self.bar.update(1)

    def log_before_training(self, metrics: dict) -> None:
        """Validation of the initial weights: step -1 in every sink, and one line."""
        if not self.enabled:
            return
        for sink in self.sinks:
            sink.write(-1, metrics)
        shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith("val/pass@"))
        print(f"mgrpo: validation before training: {shown}", flush=True)

    def log_completions(self, step: int, samples: list, advantages, tokenizer, entropies=None) -> None:
        """Every completions_interval steps (and the first): texts, rewards, advantage, finish, weight version;
        with logging.log_entropy each response token's entropy (`entropy_due` steps; None where not trained)."""
        g = self.cfg.logging
        if not self.enabled or self.completions is None or step % g.completions_interval:
            return
        for k, (s, adv) in enumerate(zip(samples, advantages)):
            reward = s.reward if s.reward is None or math.isfinite(s.reward) else None  # JSON has no NaN
            row = {
                "step": step,
                "group": s.group_id,
                "prompt": tokenizer.decode(s.prompt_ids),
                "completion": tokenizer.decode(s.response_ids),
                "rewards": s.info.get("rewards", {}),
                "reward": reward,
                "advantage": float(adv),
                "finish_reason": s.finish_reason,
                "weight_version": s.weight_version,
            }
            if "id" in s.info:  # the data row's own id column: which prompt this was, whatever its text
                row["id"] = s.info["id"]
            if s.info.get("reward_failed"):
                row["reward_failed"] = s.info["reward_failed"]
            if g.completions_token_ids:
                row.update(prompt_ids=s.prompt_ids, response_ids=s.response_ids)
            if entropies is not None:
                row["token_entropy"] = entropies[k]
            self.completions.write(json.dumps(row) + "\n")
        self.completions.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._warnings_above_bar.__exit__(None, None, None)
        self.bar.close()
        for sink in self.sinks:
            sink.close()
        if self.completions:
            self.completions.close()
        if self.cfg.logging.report and self.steps_logged:  # a run that failed before its first step has none
            from mgrpo.report import save_report

            path = save_report(self.dir)
            print(f"mgrpo: report written to {path}", file=sys.stderr, flush=True)
