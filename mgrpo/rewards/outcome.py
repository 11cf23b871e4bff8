"""Built-in outcome rewards, ms-swift's and verl's by name. Each is a per-sample function of the completion text;
the ones that run math-verify are isolated (worker processes, per-call timeout).

- `accuracy`: the answer in the last `\\boxed{...}` or `<answer>...</answer>` (else the whole text) against the row's
  `solution`, by math-verify (1.0 / 0.0; None without a solution);
- `format`: `<think>...</think>` then `<answer>...</answer>` and nothing else (1.0 / 0.0);
- `react_format`: `<think>...</think>` then `Action:` and `Action Input:` (1.0 / 0.0);
- `cosine`: length-shaped correctness (Demystifying Long CoT): short right answers score highest, short wrong
  ones lowest;
- `repetition`: -(share of repeated word n-grams) x max_penalty;
- `soft_overlong`: DAPO's length penalty on the response's model tokens (all turns): 0 up to L_max - cache, then
  linear down to -1 at L_max, and -1 beyond.
"""

from __future__ import annotations

import logging
import math
import re
import threading

from mgrpo.rewards.registry import register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notes: our pool bounds each call


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tagged = _ANSWER.findall(text)
    return tagged[-1].strip() if tagged else text


def verify_answer(completion: str, solution) -> bool:
    """math-verify's equivalence; its own SIGALRM timeouts only where they work (a main thread), otherwise the
    caller's timeout (the reward pool) bounds it."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    limits = {} if main else {"parsing_timeout": None}
    answer = extract_answer(completion)
    gold = parse(f"${solution}$" if not str(solution).startswith("$") else str(solution), **limits) or parse(
        str(solution), **limits
    )
    guess = parse(f"${answer}$", **limits) or parse(answer, **limits)
    if not gold or not guess:
        return False
    return bool(verify(gold, guess, **({} if main else {"timeout_seconds": None})))


@register_reward("accuracy", per_sample=True, isolated=True)
def accuracy(completion: str, solution=None, **_):
    if solution is None:
        return None
    return 1.0 if verify_answer(completion, solution) else 0.0


@register_reward("format", per_sample=True)
def format_reward(completion: str, **_):
    return 1.0 if re.fullmatch(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", completion, re.DOTALL) else 0.0


@register_reward("react_format", per_sample=True)
def react_format(completion: str, **_):
    pattern = r"\s*<think>.*?</think>\s*Action:.*?Action Input:.*"
    return 1.0 if re.fullmatch(pattern, completion, re.DOTALL) else 0.0


@register_reward("cosine", per_sample=True, isolated=True)
def cosine(
    completion: str,
    solution=None,
    length: int = 0,
    max_tokens: int | None = None,
    cosine_min_len_value_wrong: float = -0.5,
    cosine_max_len_value_wrong: float = 0.0,
    cosine_min_len_value_correct: float = 1.0,
    cosine_max_len_value_correct: float = 0.5,
    cosine_max_len: int | None = None,
    **_,
):
    """ms-swift's CosineReward: value = lo + (hi - lo) (1 + cos(pi length / max_len)) / 2."""
    if solution is None:
        return None
    max_len = cosine_max_len or max_tokens or max(length, 1)
    if verify_answer(completion, solution):
        lo, hi = cosine_max_len_value_correct, cosine_min_len_value_correct
    else:
        lo, hi = cosine_max_len_value_wrong, cosine_min_len_value_wrong
    return lo + 0.5 * (hi - lo) * (1.0 + math.cos(math.pi * min(length, max_len) / max_len))


@register_reward("repetition", per_sample=True)
def repetition(completion: str, repetition_n_grams: int = 3, repetition_max_penalty: float = -1.0, **_):
    """ms-swift's RepetitionPenalty: max_penalty x (1 - unique n-grams / n-grams) over words (0 when too short)."""
    words = completion.lower().split()
    n = repetition_n_grams
    if len(words) < n:
        return 0.0
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return (1.0 - len(set(grams)) / len(grams)) * repetition_max_penalty


@register_reward("soft_overlong", per_sample=True)
def soft_overlong(
    completion: str,
    length: int = 0,
    max_tokens: int | None = None,
    soft_max_length: int | None = None,
    soft_cache_length: int = 0,
    **_,
):
    """DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13), L_max = soft_max_length (default: the response's
    token budget), L_cache = soft_cache_length, |y| = `length`, the response's model tokens (loss-mask tokens of
    every turn): 0 while |y| <= L_max - L_cache, then (L_max - L_cache - |y|) / L_cache, and -1 past L_max."""
    limit = soft_max_length or max_tokens
    if not limit or soft_cache_length <= 0:
        raise ValueError(
            "soft_overlong needs reward.kwargs.soft_cache_length > 0 (and soft_max_length, default "
            "the response's token budget)"
        )
    excess = length - (limit - soft_cache_length)
    return max(min(-excess / soft_cache_length, 0.0), -1.0)
