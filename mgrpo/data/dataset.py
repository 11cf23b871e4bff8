"""Prompt datasets through HF `datasets`: local jsonl, json, parquet files and `save_to_disk` folders.

Each row needs a `prompt` string or a `messages` chat list (`data.prompt_key` / `data.messages_key`); every
other column travels with the row into `Sample.info`, where reward functions read it by name. Prompts are
tokenized once at load (through the tokenizer's chat template) and rows longer than `data.max_prompt_length`
are dropped and counted, never truncated. Every unusable row is reported, one line each (file, row, fix),
before any process group starts. `PromptStream` walks the rows in an epoch order that depends only on (seed,
epoch), so its position is two integers that a checkpoint can save and restore.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
MAX_REPORTED = 20  # bad rows listed one per line; the rest are counted


class DatasetError(ValueError):
    """A dataset file or row we cannot use; one line per problem, each naming the file, the row and the fix."""


@dataclass
class PromptSet:
    """A loaded, checked, tokenized prompt file."""

    path: str
    rows: list  # {"messages": [...], "prompt_ids": [...], **other columns}
    total: int  # rows in the file
    too_long: int = 0  # dropped: longer than data.max_prompt_length tokens
    columns: list = field(default_factory=list)

    def summary(self) -> str:
        kept = f"{len(self.rows)} of {self.total} prompts"
        cut = f"; {self.too_long} longer than max_prompt_length dropped" if self.too_long else ""
        return f"{self.path}: {kept}{cut}; columns {', '.join(self.columns)}"


def open_table(path: str, field_name: str = "data.path"):
    """The file or folder as a `datasets.Dataset` (one split), or DatasetError naming the field and the fix.
    Without the `datasets` package (e.g. a bare GPU image) a .jsonl file is still read, with the json module."""
    try:
        import datasets
    except ImportError:
        if os.path.exists(path) and path.lower().endswith(".jsonl"):
            return _read_jsonl(path, field_name)
        raise DatasetError(
            f"{field_name}={path!r}: reading it needs the `datasets` package (pip install "
            f"datasets); without it only .jsonl files are read"
        ) from None

    datasets.disable_progress_bars()
    if not os.path.exists(path):
        raise DatasetError(
            f"{field_name}={path!r}: not found; give a .jsonl, .json or .parquet file or a "
            f"save_to_disk folder (relative paths are from {os.getcwd()})"
        )
    try:
        if os.path.isdir(path):
            table = datasets.load_from_disk(path)
            if isinstance(table, datasets.DatasetDict):
                splits = ", ".join(table)
                raise DatasetError(
                    f"{field_name}={path!r} holds several splits ({splits}); point at one split's "
                    f"folder, e.g. {os.path.join(path, next(iter(table)))}"
                )
            return table
        kind = FORMATS.get(os.path.splitext(path)[1].lower())
        if kind is None:
            raise DatasetError(
                f"{field_name}={path!r}: unknown format; use .jsonl, .json, .parquet or a save_to_disk folder"
            )
        if os.path.getsize(path) == 0 or (kind == "json" and not _has_text(path)):
            raise DatasetError(f"{field_name}={path!r} is empty; it needs at least one row with a prompt")
        if path.lower().endswith(".jsonl"):  # name the line datasets would only call a DatasetGenerationError
            _read_jsonl(path, field_name)
        return datasets.load_dataset(kind, data_files=path, split="train")
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001  (arrow, json and file errors: one line naming the file)
        text = " ".join(str(exc).split())[:300]
        raise DatasetError(
            f"{field_name}={path!r}: cannot be read as a dataset ({type(exc).__name__}: {text}); "
            f"check the file's format"
        ) from None


def _has_text(path: str) -> bool:
    with open(path, "rb") as f:
        return any(line.strip() for line in f)


class _Rows(list):
    column_names: list


def _read_jsonl(path: str, field_name: str) -> _Rows:
    """Rows of a JSON-lines file with every column present in every row (None where a row lacks it), as
    `datasets` gives them."""
    from mgrpo.fsutil import JsonlLineError, read_jsonl

    try:
        rows = read_jsonl(path)
    except JsonlLineError as exc:
        raise DatasetError(f"{field_name}={path!r}: {exc}; check the file's format") from None
    columns = list(dict.fromkeys(k for r in rows for k in r))
    table = _Rows({k: r.get(k) for k in columns} for r in rows)
    table.column_names = columns
    return table


def row_messages(row: dict, prompt_key: str, messages_key: str) -> tuple:
    """(messages, None) for a usable row, or (None, why it is not usable and how to fix it)."""
    messages, prompt = row.get(messages_key), row.get(prompt_key)
    if messages is not None:
        if not isinstance(messages, list):
            return (
                None,
                f"'{messages_key}' is a {type(messages).__name__}; it must be a list of {{role, content}} messages",
            )
        if not messages:
            return None, f"'{messages_key}' is empty; give at least one {{role, content}} message"
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return None, f"'{messages_key}'[{k}] is not a {{role: str, content: str}} message"
        return messages, None
    if prompt is None:
        return (
            None,
            f"no prompt; add a non-empty '{prompt_key}' string or a '{messages_key}' list (or set "
            f"data.prompt_key / data.messages_key)",
        )
    if not isinstance(prompt, str):
        return None, f"'{prompt_key}' is a {type(prompt).__name__}; it must be a string"
    if not prompt.strip():
        return None, f"'{prompt_key}' is empty; give the prompt text or remove the row"
    return [{"role": "user", "content": prompt}], None


def encode_prompt(tokenizer, messages: list, apply_chat_template: bool = True) -> list:
    """Prompt token ids: the chat template with the generation prompt, or the plain text if there is none."""
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def load_prompts(path: str, tokenizer, data_cfg, field_name: str = "data.path", progress: bool = False) -> PromptSet:
    """Read, check and tokenize every row; raises DatasetError listing every bad row (one line each)."""
    from tqdm import tqdm

    table = open_table(path, field_name)
    pk, mk, limit = data_cfg.prompt_key, data_cfg.messages_key, data_cfg.max_prompt_length
    columns = list(table.column_names)
    if pk not in columns and mk not in columns:
        raise DatasetError(
            f"{path}: no '{pk}' or '{mk}' column (columns: {', '.join(columns)}); rename the "
            f"prompt column or set data.prompt_key / data.messages_key"
        )
    rows, bad, too_long = [], [], 0
    for i, row in enumerate(
        tqdm(table, desc=f"prompts {os.path.basename(path)}", unit="row", disable=not progress or len(table) < 5000)
    ):
        messages, why = row_messages(row, pk, mk)
        limit_tokens = row.get("max_tokens")  # the row's own response limit (GenerationRequest.max_tokens)
        if limit_tokens is not None and (
            isinstance(limit_tokens, bool) or not isinstance(limit_tokens, int) or limit_tokens < 1
        ):
            why = f"max_tokens={limit_tokens!r}: a positive integer (this prompt's response limit) or null"
        if why:
            bad.append(f"{path}: row {i}: {why}")
            continue
        ids = encode_prompt(tokenizer, messages, data_cfg.apply_chat_template)
        if limit is not None and len(ids) > limit:
            too_long += 1
            continue
        extra = {k: v for k, v in row.items() if k not in (pk, mk) and v is not None}
        rows.append({**extra, "messages": messages, "prompt_ids": ids})
    if bad:
        more = [f"{path}: ... and {len(bad) - MAX_REPORTED} more bad rows"] if len(bad) > MAX_REPORTED else []
        raise DatasetError("\n".join(bad[:MAX_REPORTED] + more))
    if not rows:
        why = (
            f"all {len(table)} prompts are longer than data.max_prompt_length={limit} tokens; raise it"
            if too_long
            else "no rows"
        )
        raise DatasetError(f"{path}: {why}")
    return PromptSet(path, rows, len(table), too_long, columns)


def load_run_data(cfg, tokenizer, progress: bool = False) -> tuple:
    """(training PromptSet, held-out PromptSet or None when validation is off)."""
    train = load_prompts(cfg.data.path, tokenizer, cfg.data, "data.path", progress)
    held_out = load_prompts(cfg.eval.path, tokenizer, cfg.data, "eval.path", progress) if cfg.eval.interval else None
    return train, held_out


class PromptStream:
    """Endless batches of prompt rows. Epoch e's order is a shuffle seeded by (seed, e) alone, so the position
    is (epoch, index) and `load_state_dict` puts a new stream exactly where a saved one was."""

    def __init__(self, rows: list, batch_size: int, shuffle: bool = True, seed: int = 0):
        self.rows, self.batch_size, self.shuffle, self.seed = rows, batch_size, shuffle, seed
        self.epoch, self.pos = 0, 0
        self.order = self._order(0)

    def _order(self, epoch: int) -> list:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, size: int | None = None) -> list:
        batch = []
        while len(batch) < (size or self.batch_size):
            if self.pos >= len(self.order):
                self.epoch, self.pos = self.epoch + 1, 0
                self.order = self._order(self.epoch)
            batch.append(self.rows[self.order[self.pos]])
            self.pos += 1
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("rows") != len(self.rows):
            raise DatasetError(
                f"the saved prompt position is for a dataset of {state.get('rows')} rows, this one "
                f"has {len(self.rows)}; resume with the same data.path and data.max_prompt_length"
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.pos = state["epoch"], state["pos"]
        self.order = self._order(self.epoch)
