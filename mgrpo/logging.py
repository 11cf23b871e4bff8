"""metrics.jsonl (one line per step, flushed) and a progress bar that shows the step's key numbers."""
from __future__ import annotations

import json
import os

from tqdm import tqdm

SHOWN = {"reward_mean": "reward", "approx_kl": "kl_old", "clip_frac": "clip", "tokens_per_s": "tok/s",
         "time_rollout": "t_roll", "time_train": "t_train", "time_sync": "t_sync"}


class RunLogger:
    def __init__(self, output_dir: str, total_steps: int, enabled: bool = True, progress_bar: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.file = open(self.path, "w")
        self.bar = tqdm(total=total_steps, desc="grpo", unit="step", dynamic_ncols=True, disable=not progress_bar)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        self.bar.set_postfix({short: f"{metrics[k]:.3g}" for k, short in SHOWN.items() if k in metrics})
        self.bar.update(1)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
