"""The embedded default's config on a model folder a test already made, for in-process trainer runs."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_run_config(model: str, out, *flags):
    """examples/tiny_cpu.yaml on `model` with the tiny prompts, writing to `out`, no progress bar, plus `flags`."""
    from mgrpo.config import load_config

    cfg = load_config(
        os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
        [
            "--model.path",
            model,
            "--data.path",
            os.path.join(ROOT, "examples/data/tiny_prompts.jsonl"),
            "--logging.output_dir",
            str(out),
            "--logging.progress_bar",
            "false",
            *flags,
        ],
    )
    cfg.model.tiny = None
    return cfg
