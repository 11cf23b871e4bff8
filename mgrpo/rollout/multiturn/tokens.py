"""Token bookkeeping for multi-turn rollouts: the tokens of messages appended to a conversation (never the
history re-templated), text-position truncation of a turn's tokens, and per-turn seeds.

Why never re-template: a chat template may render history differently from how the model saw it (Qwen3's drops
the `<think>` block of earlier assistant turns), and decode-then-encode does not give back the same ids. Both
would make the trainer score tokens the engine never sampled.
"""

from __future__ import annotations

import hashlib

DUMMY_USER = "mgrpo-dummy-user-7f3a"
DUMMY_ASSISTANT = "mgrpo-dummy-assistant-7f3a"


class TemplateError(ValueError):
    """The chat template cannot render appended messages after a fixed prefix; the message says why."""


class MessageTokens:
    """Tokens of new messages as the chat template renders them after an assistant turn.

    Renders `[dummy user, dummy assistant] + new` with the generation prompt and keeps what follows the dummy
    assistant's content: its end-of-turn marker (e.g. `<|im_end|>\\n`), the new messages and the next assistant
    header. The caller drops the leading end-of-turn token when the model already emitted it.
    """

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer, self.kwargs = tokenizer, dict(chat_template_kwargs or {})
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "the tokenizer has no chat template; multi-turn schedulers that append messages "
                "need one (or return response_token_ids from step() themselves)"
            )

    def render_tail(self, new_messages: list) -> str:
        dummy = [{"role": "user", "content": DUMMY_USER}, {"role": "assistant", "content": DUMMY_ASSISTANT}]
        text = self.tokenizer.apply_chat_template(
            dummy + list(new_messages), tokenize=False, add_generation_prompt=True, **self.kwargs
        )
        at = text.find(DUMMY_ASSISTANT)
        if at < 0 or text.find(DUMMY_ASSISTANT, at + 1) >= 0:
            raise TemplateError(
                "the chat template does not render an earlier assistant message verbatim exactly "
                "once, so the tokens of appended messages cannot be isolated"
            )
        return text[at + len(DUMMY_ASSISTANT) :]

    def new_messages(self, new_messages: list) -> list:
        return list(self.tokenizer.encode(self.render_tail(new_messages), add_special_tokens=False))

    def text(self, text: str) -> list:
        """Plain text appended inside the current assistant message (a continuation)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []


def truncate_at_text(tokenizer, token_ids: list, n_chars: int) -> int:
    """The fewest leading tokens whose decoded text (special tokens skipped) reaches `n_chars` characters."""
    lo, hi = 0, len(token_ids)
    while lo < hi:  # decoded length grows with the token count
        mid = (lo + hi) // 2
        if len(tokenizer.decode(token_ids[:mid], skip_special_tokens=True)) >= n_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def turn_seed(seed: int, turn: int) -> int:
    """Turn 1 keeps the trajectory's own seed (a one-turn trajectory samples as a single-turn request would);
    later turns derive a fresh 63-bit stream from (seed, turn)."""
    if turn <= 1:
        return int(seed)
    digest = hashlib.blake2b(f"{seed}:turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
