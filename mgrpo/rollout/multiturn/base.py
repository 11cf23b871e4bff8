"""`RolloutScheduler` (one turn) and `MultiTurnScheduler` (ms-swift's run loop and hooks), token in, token out.

A scheduler is the environment plus the episode's referee: between engine calls it decides whether the
trajectory is done (`check_finished`, `on_turn_end`'s `done`) and what the next turn sees (`step`). State of one
trajectory lives in `run()`'s locals or is keyed by `request.uuid`: one scheduler runs many trajectories at once.

Each turn the loop appends to one token stream after the initial prompt: the turn's tokens (the engine's, or
`step()`'s `response_token_ids`), then the tokens of whatever `step()` added to the messages. Text appended to the
last assistant message is encoded as is; new messages are rendered by the chat template after a fixed dummy
prefix (`tokens.MessageTokens`). Those environment tokens get loss mask 0 and no logprobs. The next turn's
prompt is the previous prompt + the turn's tokens + the environment tokens: history is never re-templated.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import replace

from mgrpo.rollout.multiturn.tokens import MessageTokens
from mgrpo.rollout.multiturn.types import InferRequest, ResponseChoice, RolloutOutput


class SchedulerError(RuntimeError):
    """A scheduler broke the contract (what step() returned, how it changed the messages)."""


class RolloutScheduler:
    """Single turn: one engine call, every token trained. Subclass and override `run()` for custom single-turn
    logic; the hooks are shared with `MultiTurnScheduler`."""

    def __init__(self, infer_engine=None, max_turns: int | None = None, *args, **kwargs):
        self.infer_engine = (
            infer_engine  # mgrpo.rollout.multiturn.driver.TurnClient, set by the driver for each rollout
        )
        self.tokenizer = kwargs.get("tokenizer")
        self.max_turns = max_turns
        self.max_total_tokens = kwargs.get("max_total_tokens")  # prompt + every turn; None: no limit
        self.chat_template_kwargs = kwargs.get("chat_template_kwargs") or {}
        self._message_tokens = None

    @property
    def message_tokens(self) -> MessageTokens:
        if self._message_tokens is None:
            self._message_tokens = MessageTokens(self.tokenizer, self.chat_template_kwargs)
        return self._message_tokens

    async def on_trajectory_start(self, requests: list) -> None:
        """Before the first turn; may rewrite `request.messages` (the prompt is then encoded from them)."""

    async def on_turn_end(
        self, infer_request: InferRequest, response_choice: ResponseChoice, current_turn: int
    ) -> dict:
        """After the turn's text is appended to the messages, before `check_finished`. May return `done` (overrides
        check_finished) and `rollout_infos` (merged into the trajectory's infos, which reach `Sample.info`)."""
        return {}

    async def on_trajectory_end(self, requests: list, error: BaseException | None = None) -> None:
        """Once per trajectory, after success or failure: release environments and other resources."""

    async def run(self, infer_request: InferRequest, sampling, **kwargs) -> RolloutOutput:
        response = await self.infer_engine.infer_async(infer_request, sampling)
        choice = response.choices[0]
        messages = infer_request.messages + [{"role": "assistant", "content": choice.message.content}]
        return RolloutOutput(
            messages=messages,
            response_token_ids=[list(choice.token_ids)],
            response_loss_mask=[[1] * len(choice.token_ids)],
            rollout_logprobs=[list(choice.token_logprobs)],
            rollout_infos={"num_turns": 1},
            finish_reason=choice.finish_reason,
            response=response,
            weight_version=choice.weight_version,
            token_versions=turn_versions(choice, len(choice.token_ids)),
        )

    @staticmethod
    def append_assistant_completion(infer_request: InferRequest, completion: str) -> bool:
        """Continue the last assistant message (True) or start a new one (False)."""
        messages = infer_request.messages
        if messages and messages[-1]["role"] == "assistant":
            messages[-1]["content"] += completion
            return True
        messages.append({"role": "assistant", "content": completion})
        return False

    @staticmethod
    def _extract_logprobs_from_choice(response_choice: ResponseChoice) -> list:
        return list(response_choice.token_logprobs or [])


def turn_versions(choice: ResponseChoice, n: int) -> list:
    """The versions of a turn's n tokens: the engine's per-token versions (the first n: a scheduler may drop the
    last), or the turn's version for all when it rewrote them."""
    versions = list(choice.token_versions or ())
    return versions[:n] if len(versions) >= n else [choice.weight_version] * n


class TokenStream:
    """What followed the initial prompt: ids, loss mask, logprobs of the mask-1 tokens (ms-swift's rule)."""

    def __init__(self):
        self.ids, self.mask, self.logprobs, self.versions = [], [], [], []

    def add(self, ids: list, mask: list, logprobs: list = (), versions: list | None = None) -> None:
        """`versions`: the weight version of each token; None: the latest so far (environment tokens)."""
        if len(mask) != len(ids):
            raise SchedulerError(
                f"response_loss_mask has {len(mask)} entries for {len(ids)} response_token_ids; "
                f"return them with the same length"
            )
        if any(m not in (0, 1) for m in mask):
            raise SchedulerError("response_loss_mask values must be 0 or 1")
        self.ids += list(ids)
        self.mask += list(mask)
        self.logprobs += list(logprobs)
        self.versions += list(versions) if versions is not None else [max(self.versions, default=0)] * len(ids)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (and the logprobs of the mask-1 ones among them)."""
        self.logprobs = self.logprobs[: sum(self.mask[:n])] if len(self.logprobs) == sum(self.mask) else []
        self.ids, self.mask, self.versions = self.ids[:n], self.mask[:n], self.versions[:n]


class MultiTurnScheduler(RolloutScheduler):
    """ms-swift's loop: generate, append the text, `on_turn_end`, `check_finished` (or `done`); if not done,
    `step()` builds the next request. Subclasses implement `step()` (and usually `check_finished`), or only the
    hooks (see GymScheduler), or `run()` itself."""

    def step(self, infer_request: InferRequest, response_choice: ResponseChoice, current_turn: int) -> dict:
        """Return {"infer_request": the next request (required), "response_token_ids" and "response_loss_mask"
        (optional, together: this turn's tokens when the scheduler rewrote them, e.g. truncated plus a tip with
        mask 0), "rollout_logprobs" (optional: one per mask-1 token of those), "rollout_infos" (optional)}."""
        raise NotImplementedError("implement step() in your MultiTurnScheduler subclass, or override run()")

    def check_finished(self, infer_request: InferRequest, response_choice: ResponseChoice, current_turn: int) -> bool:
        if response_choice.finish_reason == "length":
            return True
        return bool(self.max_turns and current_turn >= self.max_turns)

    async def run(self, infer_request: InferRequest, sampling, **kwargs) -> RolloutOutput:
        req = infer_request
        original = copy.deepcopy(req.messages)
        await self.on_trajectory_start([req])
        if req.messages != original or not req.prompt_ids:  # the hook rewrote the conversation: encode it once
            from mgrpo.data.dataset import encode_prompt

            req.prompt_ids = encode_prompt(self.tokenizer, req.messages)
        prompt, stream, infos = list(req.prompt_ids), TokenStream(), {}
        turn, finish, version, choice, response = 1, "stop", None, None, None
        eos = getattr(self.tokenizer, "eos_token_id", None)
        while True:
            budget = self.max_total_tokens - len(req.prompt_ids) if self.max_total_tokens else None
            if budget is not None and budget <= 0:
                finish, turn = "length", turn - 1  # this turn never ran
                break
            sp = sampling if budget is None or budget >= sampling.max_tokens else replace(sampling, max_tokens=budget)
            response = await self.infer_engine.infer_async(req, sp)
            choice = response.choices[0]
            version = choice.weight_version if version is None else min(version, choice.weight_version)
            finish = choice.finish_reason
            self.append_assistant_completion(req, choice.message.content)
            before = (len(req.messages), req.messages[-1]["content"])
            result = await self.on_turn_end(req, choice, turn) or {}
            infos.update(result.get("rollout_infos") or {})
            stop = self.check_finished(req, choice, turn)
            if "done" in result:
                stop = bool(result["done"])
            if stop or (self.max_turns and turn >= self.max_turns):
                stream.add(
                    choice.token_ids,
                    [1] * len(choice.token_ids),
                    choice.token_logprobs,
                    turn_versions(choice, len(choice.token_ids)),
                )
                break
            ret = self.step(req, choice, turn)
            ret = await ret if inspect.isawaitable(ret) else ret
            if not isinstance(ret, dict) or not isinstance(ret.get("infer_request"), InferRequest):
                raise SchedulerError(
                    f"{type(self).__name__}.step() must return a dict with an InferRequest under "
                    f"'infer_request'; got {type(ret).__name__}"
                )
            req = ret["infer_request"]
            infos.update(ret.get("rollout_infos") or {})
            self._append_turn(stream, choice, ret, before, req.messages, eos)
            req.prompt_ids = prompt + stream.ids
            if self.max_total_tokens and len(req.prompt_ids) > self.max_total_tokens:
                stream.truncate(self.max_total_tokens - len(prompt))
                finish = "length"
                break
            turn += 1
        return RolloutOutput(
            messages=req.messages,
            response_token_ids=stream.ids,
            response_loss_mask=stream.mask,
            rollout_logprobs=stream.logprobs,
            rollout_infos={**infos, "num_turns": turn},
            finish_reason=finish,
            response=response,
            weight_version=version or 0,
            prompt_ids=prompt,
            token_versions=stream.versions,
        )

    def _append_turn(
        self, stream: TokenStream, choice: ResponseChoice, ret: dict, before: tuple, messages: list, eos
    ) -> None:
        """The turn's tokens, then the environment's: text appended to the assistant message, new messages."""
        n_before, assistant_text = before
        if "response_token_ids" in ret:  # the scheduler accounts for its own edits of the assistant message
            ids = list(ret["response_token_ids"])
            mask = list(ret.get("response_loss_mask") or [1] * len(ids))
            lps = list(ret.get("rollout_logprobs") or choice.token_logprobs)
            appended = ""
        else:
            ids, mask, lps = list(choice.token_ids), [1] * len(choice.token_ids), list(choice.token_logprobs)
            if len(messages) < n_before or messages[n_before - 1]["role"] != "assistant":
                raise SchedulerError(
                    "step() removed or replaced messages; only append messages or text, or return "
                    "response_token_ids for the turn"
                )
            content = messages[n_before - 1]["content"]
            if not content.startswith(assistant_text):
                raise SchedulerError(
                    "step() rewrote the assistant message; appending text is fine, anything else "
                    "must come with response_token_ids (and response_loss_mask) for the turn"
                )
            appended = content[len(assistant_text) :]
        new = messages[n_before:]
        env = self.message_tokens.text(appended) if appended else []
        if new:
            env += self.message_tokens.new_messages(new)
        closes = bool(env) and eos is not None and ids and ids[-1] == eos
        if closes and appended:  # the assistant message goes on: its end-of-turn token is not part of it
            lps = lps[:-1] if mask[-1] and lps else lps
            ids, mask = ids[:-1], mask[:-1]
        elif closes and env[0] == eos:  # the model closed its turn itself
            env = env[1:]
        stream.add(ids, mask, lps, turn_versions(choice, len(ids)))
        stream.add(env, [0] * len(env))
