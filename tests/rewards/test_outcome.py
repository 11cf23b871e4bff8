"""Built-in rewards (true and false cases), dataset columns by name, isolated rewards under a timeout (a reward
that sleeps forever is killed and only its sample fails), async rewards run concurrently, the ms-swift ORM
adapter, and a sequence-classification reward model against HF's own forward."""

import concurrent.futures
import math
import textwrap
import time

import pytest

from mgrpo.plugins import load_plugins
from mgrpo.rewards import ScoreOptions, SequenceClassifierReward, orms, register_reward, score
from mgrpo.rewards.outcome import accuracy, cosine, format_reward, react_format, repetition, soft_overlong
from mgrpo.rollout.types import Sample


def sample(text, **info):
    return Sample(
        prompt_ids=[1],
        response_ids=[2] * max(1, len(text) // 4),
        loss_mask=[1] * max(1, len(text) // 4),
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
        info=info,
    )


ACCURACY_CASES = [  # (completion, solution, expected)
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    ("<answer>0.5</answer>", r"\frac{1}{2}", 1.0),
    (r"\boxed{35}", "35", 1.0),
    (r"\boxed{2}", "0.5", 0.0),
    ("<answer>36</answer>", "35", 0.0),
    ("no answer at all", "35", 0.0),
]


def test_accuracy_true_and_false_from_worker_threads():
    """math-verify's SIGALRM cannot run outside the main thread; the reward works there anyway."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: accuracy(c[0], solution=c[1]), ACCURACY_CASES))
    assert got == [c[2] for c in ACCURACY_CASES]
    assert accuracy(r"\boxed{1}") is None  # no solution column: not applicable


def test_accuracy_through_score_in_worker_processes():
    samples = [sample(c, solution=s) for c, s, _ in ACCURACY_CASES]
    score(samples, None, ["accuracy"], options=ScoreOptions(timeout_s=20, workers=2))
    assert [s.reward for s in samples] == [c[2] for c in ACCURACY_CASES]


def test_format_react_cosine_repetition_soft_overlong():
    assert format_reward("<think>a</think>\n<answer>1</answer>") == 1.0
    assert format_reward("<think>a</think><answer>1</answer> trailing") == 0.0
    assert format_reward("<answer>1</answer>") == 0.0
    assert react_format("<think>use the tool</think>\nAction: calculator\nAction Input: 2+2") == 1.0
    assert react_format("Action: calculator\nAction Input: 2+2") == 0.0
    right_short = cosine(r"\boxed{4}", solution="4", length=2, max_tokens=100)
    right_long = cosine(r"\boxed{4}", solution="4", length=100, max_tokens=100)
    wrong_short = cosine(r"\boxed{5}", solution="4", length=2, max_tokens=100)
    wrong_long = cosine(r"\boxed{5}", solution="4", length=100, max_tokens=100)
    assert right_short == pytest.approx(1.0, abs=1e-3) and right_long == pytest.approx(0.5)
    assert wrong_short == pytest.approx(-0.5, abs=1e-3) and wrong_long == pytest.approx(0.0)
    assert repetition("a b c d e f g") == 0.0
    assert repetition("a b c a b c a b c a b c") == pytest.approx(-(1 - 3 / 10))
    assert soft_overlong("", length=20, max_tokens=32, soft_cache_length=8) == 0.0
    assert soft_overlong("", length=28, max_tokens=32, soft_cache_length=8) == pytest.approx(-0.5)
    assert soft_overlong("", length=32, max_tokens=32, soft_cache_length=8) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="soft_cache_length"):
        soft_overlong("", length=3, max_tokens=32)


def _dapo_overlong(y: int, l_max: int, l_cache: int) -> float:
    """DAPO's eq. 13, written out case by case (arXiv:2503.14476): the reference."""
    if y <= l_max - l_cache:
        return 0.0
    if y <= l_max:
        return (l_max - l_cache - y) / l_cache
    return -1.0


def test_soft_overlong_is_dapos_and_floored_at_minus_one():
    """Every length from 0 to 3 x L_max against eq. 13. Lengths past L_max occur in multi-turn trajectories (every
    turn may take max_tokens); without the floor the former formula gave -(y - 24) / 8, e.g. -3.5 at y = 52: the
    negative control."""
    for y in range(0, 97):
        assert soft_overlong("", length=y, max_tokens=32, soft_cache_length=8) == pytest.approx(
            _dapo_overlong(y, 32, 8)
        ), y
    assert soft_overlong("", length=52, max_tokens=32, soft_cache_length=8) == -1.0 != -(52 - 24) / 8


def test_soft_overlong_measures_the_whole_trajectory_against_its_budget():
    """A three-turn trajectory: 10 + 12 + 9 model tokens with 6 + 5 environment tokens between them (loss mask 0).
    |y| is the 31 model tokens, L_max the trajectory's budget max_turns x max_tokens = 3 x 12 = 36 (not one turn's
    12, which the former options passed: -1 for any trajectory longer than one turn), L_cache 8: (28 - 31) / 8."""
    from mgrpo.config import RolloutConfig
    from mgrpo.rewards.registry import response_token_budget

    mask = [1] * 10 + [0] * 6 + [1] * 12 + [0] * 5 + [1] * 9
    traj = Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + len(mask))), loss_mask=mask)
    rollout = RolloutConfig(scheduler="tool_call", max_turns=3, max_tokens=12)
    assert response_token_budget(rollout) == 36
    assert response_token_budget(RolloutConfig(max_tokens=12)) == 12
    assert response_token_budget(RolloutConfig(scheduler="tool_call", max_tokens=12)) is None
    score(
        [traj],
        None,
        ["soft_overlong"],
        kwargs={"soft_cache_length": 8},
        options=ScoreOptions(max_tokens=response_token_budget(rollout)),
    )
    assert traj.reward == pytest.approx(_dapo_overlong(31, 36, 8)) == pytest.approx(-3 / 8)


def test_soft_overlong_config_errors_are_one_line():
    from mgrpo.config import ConfigError, load_config

    base = ["--model.path", "m", "--reward.funcs", "[soft_overlong]"]
    cases = [
        ([], "reward.kwargs.soft_cache_length=0: soft_overlong needs a cache length > 0"),
        (
            ["--reward.kwargs", "{soft_cache_length: 8}", "--rollout.scheduler", "tool_call"],
            "reward.kwargs.soft_max_length is unset and rollout.scheduler=tool_call has no rollout.max_turns",
        ),
        (
            ["--reward.kwargs", "{soft_cache_length: 64}", "--rollout.max_tokens", "32"],
            "reward.kwargs.soft_cache_length=64 must be below the limit 32",
        ),
    ]
    for extra, expect in cases:
        with pytest.raises(ConfigError) as err:
            load_config(argv=base + extra, check_files=False)
        assert any(expect in line for line in str(err.value).splitlines()), str(err.value)
    load_config(
        argv=base
        + ["--reward.kwargs", "{soft_cache_length: 8}", "--rollout.scheduler", "tool_call", "--rollout.max_turns", "3"],
        check_files=False,
    )


@register_reward("_t_columns")
def _columns(samples, tokenizer, solution, difficulty=None, **_):
    return [float(s == "4") + (d or 0) for s, d in zip(solution, difficulty or [None] * len(samples))]


def test_dataset_columns_reach_rewards_by_name():
    samples = [sample("x", solution="4", difficulty=0.5), sample("y", solution="5", difficulty=0.25)]
    score(samples, None, ["_t_columns"])
    assert [s.reward for s in samples] == [1.5, 0.25]


@register_reward("_t_async_slow")
async def _async_slow(samples, tokenizer, **_):
    import asyncio

    await asyncio.sleep(0.6)
    return [1.0] * len(samples)


@register_reward("_t_async_slow2")
async def _async_slow2(samples, tokenizer, **_):
    import asyncio

    await asyncio.sleep(0.6)
    return [2.0] * len(samples)


@register_reward("_t_async_hang")
async def _async_hang(samples, tokenizer, **_):
    import asyncio

    await asyncio.sleep(3600)


def test_async_rewards_run_concurrently_and_time_out():
    samples = [sample("x"), sample("y")]
    t0 = time.perf_counter()
    score(samples, None, ["_t_async_slow", "_t_async_slow2"], options=ScoreOptions(timeout_s=5))
    assert time.perf_counter() - t0 < 1.1 and [s.reward for s in samples] == [3.0, 3.0]
    t0 = time.perf_counter()
    from mgrpo.rewards.registry import AllRewardsFailed

    with pytest.raises(AllRewardsFailed, match="reward '_t_async_hang': TimeoutError"):  # every sample failed
        score(samples, None, ["_t_async_slow", "_t_async_hang"], options=ScoreOptions(timeout_s=1.0))
    assert time.perf_counter() - t0 < 2.0
    assert all(math.isnan(s.reward) and s.info["reward_failed"] == ["_t_async_hang"] for s in samples)


def test_a_reward_that_sleeps_forever_is_killed_and_only_its_sample_fails(tmp_path):
    from mgrpo.rewards.pool import shared_pool

    plugin = tmp_path / "sleepy_plugin.py"
    plugin.write_text(
        textwrap.dedent("""
        import time
        from mgrpo.rewards import register_reward

        @register_reward("_t_sleepy", per_sample=True, isolated=True)
        def sleepy(completion, **_):
            if "hang" in completion:
                time.sleep(10 ** 6)
            return float(len(completion))
    """)
    )
    load_plugins([str(plugin)])
    opts = ScoreOptions(timeout_s=1.5, workers=2, plugins=(str(plugin),))
    samples = [sample("ok"), sample("hang here"), sample("fine"), sample("also ok!")]
    t0 = time.perf_counter()
    score(samples, None, ["_t_sleepy"], options=opts)
    took = time.perf_counter() - t0
    assert [s.reward for s in samples[::2]] == [2.0, 4.0] and samples[3].reward == 8.0
    assert math.isnan(samples[1].reward) and samples[1].info["reward_failed"] == ["_t_sleepy"]
    pool = shared_pool(opts.workers, opts.plugins)
    assert pool.killed == 1 and took < 1.5 + 10, took
    again = [sample("later")]  # the replaced worker serves the next step
    score(again, None, ["_t_sleepy"], options=opts)
    assert again[0].reward == 5.0


def test_ms_swift_orm_through_the_adapter():
    class LengthOrm:  # ms-swift: __call__(completions, **kwargs) with columns as lists
        def __call__(self, completions, solution, **kwargs):
            assert "messages" in kwargs
            return [float(len(c)) + float(s) for c, s in zip(completions, solution)]

    orms["_t_len_orm"] = LengthOrm
    samples = [sample("abc", solution="1"), sample("abcdef", solution="2")]
    score(samples, None, ["_t_len_orm"])
    assert [s.reward for s in samples] == [4.0, 8.0]


def test_reward_model_scores_equal_hf_forward(tmp_path, tiny_dirs):
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

    from mgrpo.data.tokenizer import load_tokenizer

    base = tiny_dirs("rm_base", family="qwen2", vocab_size=300, num_layers=2, seed=5)
    tok = load_tokenizer(base)
    cfg = Qwen2Config.from_pretrained(base)
    cfg.num_labels, cfg.pad_token_id = 1, tok.pad_token_id
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = SequenceClassifierReward(str(tmp_path / "rm"), batch_size=2)
    samples = [sample("a short answer"), sample("a much longer answer with more words"), sample("x")]
    register_reward("_t_rm")(rm)
    score(samples, tok, ["_t_rm"])
    ref_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    for s in samples:  # one at a time, no padding: an independent reference
        text = tok.apply_chat_template(s.messages, tokenize=False)
        with torch.no_grad():
            ref = ref_model(**tok(text, return_tensors="pt")).logits[0, 0].item()
        assert s.reward == pytest.approx(ref, abs=1e-5)
    assert len({round(s.reward, 6) for s in samples}) == 3
