"""Fused vocab-parallel logprobs, registries of policy losses / advantages / KL, aggregation."""

from mgrpo.loss.registry import advantages, policy_loss, register_advantage, register_policy_loss  # noqa: F401


def __getattr__(name):
    if name == "vocab_parallel_logprobs":
        from mgrpo.loss.logprobs import vocab_parallel_logprobs

        return vocab_parallel_logprobs
    raise AttributeError(name)
