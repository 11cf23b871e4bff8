"""The trainer's own (megatron) forward as the reference an engine's logprobs must equal (shared by engine tests)."""
import torch

_ACTORS = {}


def trainer_actor(model_dir: str, temperature: float = 1.0):
    from mgrpo.actor import Actor
    from mgrpo.config import load_config

    key = (model_dir, temperature)
    if key not in _ACTORS:
        cfg = load_config(argv=["--model.path", model_dir, "--rollout.temperature", str(temperature)],
                          check_files=False)
        _ACTORS[key] = Actor(cfg, model_dir, train=False)
    return _ACTORS[key]


def trainer_logprobs(model_dir: str, prompt: list, response: list, temperature: float) -> torch.Tensor:
    """log_softmax(z / T) of `response` after `prompt` from a megatron Actor loaded from `model_dir`."""
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.rollout.types import Sample

    actor = trainer_actor(model_dir, temperature)
    s = Sample(prompt_ids=prompt, response_ids=response, loss_mask=[1] * len(response))
    mb = make_microbatches([s], 1, 0)[0]
    return actor.logprobs([mb])[0][mb["loss_mask"].bool()]
