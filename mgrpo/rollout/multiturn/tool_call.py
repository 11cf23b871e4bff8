"""`ToolCallScheduler`: ReAct tool calls (`Action: calculator` / `Action Input: 3+4`) executed between turns.

The turn is cut right after the first `Action Input:` line (whatever the model wrote past it, such as an
invented observation, is dropped with its logprobs), the tool's `Observation: ...` is appended to the same
assistant message with loss mask 0, and the model continues that message in the next turn. A turn without a
tool call ends the trajectory. Tools are plain functions `fn(text) -> str` in `self.tools`; add your own there.
"""

from __future__ import annotations

import ast
import operator
import re

from mgrpo.rollout.multiturn.base import MultiTurnScheduler
from mgrpo.rollout.multiturn.registry import register_scheduler
from mgrpo.rollout.multiturn.tokens import truncate_at_text

ACTION = re.compile(r"Action:\s*(?P<tool>[^\n]*?)\s*\nAction Input:\s*(?P<input>[^\n]*)(?:\n|$)")
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 10**30


class CalculatorError(ValueError):
    pass


def calculate(expression: str):
    """Arithmetic on numbers with + - * / // % ** and parentheses, by walking the parsed syntax tree (never
    eval): names, calls, attributes and huge powers are refused."""
    text = expression.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression must be 1-{MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {text!r}") from None

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if abs(value) > MAX_MAGNITUDE:
                raise CalculatorError("result too large")
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise CalculatorError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")

    try:
        value = walk(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    return int(value) if isinstance(value, float) and value.is_integer() else value


def calculator_tool(text: str) -> str:
    try:
        return f"Result: {calculate(text)}"
    except CalculatorError as exc:
        return f"Error: {exc}"


@register_scheduler("tool_call", "tool_call_scheduler")
class ToolCallScheduler(MultiTurnScheduler):
    observation_format = "Observation: {}\n"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = {"calculator": calculator_tool}

    @staticmethod
    def find_call(text: str):
        return ACTION.search(text)

    def check_finished(self, infer_request, response_choice, current_turn) -> bool:
        if self.find_call(response_choice.message.content) is None:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def run_tool(self, name: str, argument: str) -> str:
        tool = self.tools.get(name)
        if tool is None:
            return f"Error: unknown tool {name!r}; available: {', '.join(sorted(self.tools))}"
        try:
            return str(tool(argument))
        except Exception as exc:  # noqa: BLE001  (a tool's failure is an observation, not a crash)
            return f"Error: {type(exc).__name__}: {exc}"

    def step(self, infer_request, response_choice, current_turn) -> dict:
        completion = response_choice.message.content
        call = self.find_call(completion)
        keep = truncate_at_text(self.tokenizer, response_choice.token_ids, call.end())
        ids = list(response_choice.token_ids[:keep])
        kept_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not kept_text.endswith("\n"):  # the call line ended the turn (no newline generated)
            kept_text += "\n"
            newline = self.message_tokens.text("\n")
        else:
            newline = []
        observation = self.observation_format.format(self.run_tool(call["tool"], call["input"]))
        obs_ids = newline + self.message_tokens.text(observation)
        messages = infer_request.messages
        messages[-1]["content"] = (
            messages[-1]["content"][: len(messages[-1]["content"]) - len(completion)] + kept_text + observation
        )
        return {
            "infer_request": infer_request,
            "response_token_ids": ids + obs_ids,
            "response_loss_mask": [1] * len(ids) + [0] * len(obs_ids),
            "rollout_logprobs": list(response_choice.token_logprobs[:keep]),
            "rollout_infos": {"tool_calls": current_turn, "last_observation": observation.strip()},
        }
