"""`MathTipsScheduler` (ms-swift's `math_tip_trick`): on a wrong answer, cut the turn before its answer and
append a tip (loss mask 0, no logprobs); the model continues the same assistant message once more.

The answer is checked against the row's `solution` column with math-verify (the `accuracy` reward's check). A tip is given once.
"""

from __future__ import annotations

from mgrpo.rewards.outcome import verify_answer
from mgrpo.rollout.multiturn.base import MultiTurnScheduler
from mgrpo.rollout.multiturn.registry import register_scheduler
from mgrpo.rollout.multiturn.tokens import truncate_at_text

TIPS = "The answer is not correct, it seems you made a mistake; recheck very carefully.\n"


@register_scheduler("math_tips", "math_tip_trick")
class MathTipsScheduler(MultiTurnScheduler):
    def __init__(self, *args, tips_prompt: str = TIPS, solution_key: str = "solution", **kwargs):
        super().__init__(*args, **kwargs)
        self.tips_prompt, self.solution_key = tips_prompt, solution_key

    def check_finished(self, infer_request, response_choice, current_turn) -> bool:
        content = infer_request.messages[-1]["content"]
        if self.tips_prompt in content:  # a tip is given once
            return True
        solution = infer_request.data_dict.get(self.solution_key)
        if solution is None:
            raise KeyError(
                f"MathTipsScheduler needs a {self.solution_key!r} column in the dataset (or set "
                f"rollout.scheduler_kwargs.solution_key)"
            )
        if verify_answer(content, solution):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn) -> dict:
        completion = response_choice.message.content
        cut = min([completion.index(tag) for tag in ("<answer>", "</think>") if tag in completion] or [len(completion)])
        keep = truncate_at_text(self.tokenizer, response_choice.token_ids, cut)
        ids = list(response_choice.token_ids[:keep])
        kept = self.tokenizer.decode(ids, skip_special_tokens=True)
        tips = self.message_tokens.text(self.tips_prompt)
        message = infer_request.messages[-1]
        message["content"] = message["content"][: len(message["content"]) - len(completion)] + kept + self.tips_prompt
        return {
            "infer_request": infer_request,
            "response_token_ids": ids + tips,
            "response_loss_mask": [1] * len(ids) + [0] * len(tips),
            "rollout_logprobs": list(response_choice.token_logprobs[:keep]),
            "rollout_infos": {"tipped": True},
        }
