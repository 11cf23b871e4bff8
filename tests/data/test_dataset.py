"""Prompt data through HF `datasets`: the same rows from jsonl, json, parquet and a save_to_disk folder give the same
token ids (checked against the tokenizer's own chat template); bad rows are listed one line each and the launcher
exits 2 before any process group; over-long prompts are dropped and counted; the epoch order is fixed by the seed
and the stream's position restores exactly."""

import json
import os
import subprocess
import sys

import pytest

from mgrpo.config import DataConfig
from mgrpo.data.dataset import DatasetError, PromptStream, load_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = [
    {"prompt": "what is 2 + 2?", "answer": "4", "id": 0},
    {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}],
        "answer": "red",
        "id": 1,
    },
    {"prompt": "count to three " * 8, "answer": "1 2 3", "id": 2},
    {"messages": [{"role": "user", "content": "hello"}], "answer": "hi", "id": 3},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    from mgrpo.data.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dirs("data_qwen2", family="qwen2", num_layers=2))


def write_all_formats(tmp_path, rows) -> dict:
    import datasets

    paths = {
        "jsonl": tmp_path / "d.jsonl",
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "disk": tmp_path / "d_disk",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))
    table = datasets.load_dataset("json", data_files=str(paths["jsonl"]), split="train")
    table.to_parquet(str(paths["parquet"]))
    table.save_to_disk(str(paths["disk"]))
    return {k: str(v) for k, v in paths.items()}


def test_every_format_gives_the_same_token_ids_as_the_chat_template(tmp_path, tokenizer):
    paths = write_all_formats(tmp_path, ROWS)
    loaded = {kind: load_prompts(path, tokenizer, DataConfig()) for kind, path in paths.items()}
    reference = []
    for r in ROWS:  # independent: the tokenizer's own template on the messages we mean
        messages = r.get("messages") or [{"role": "user", "content": r["prompt"]}]
        reference.append(
            list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        )
    for kind, got in loaded.items():
        assert [row["prompt_ids"] for row in got.rows] == reference, kind
        assert [(row["answer"], row["id"]) for row in got.rows] == [(r["answer"], r["id"]) for r in ROWS], kind
        assert got.total == len(ROWS) and got.too_long == 0
    assert reference[0] != reference[1]  # the negative control: different rows give different ids


def test_over_long_prompts_are_dropped_and_counted(tmp_path, tokenizer):
    path = write_all_formats(tmp_path, ROWS)["parquet"]
    lengths = [len(row["prompt_ids"]) for row in load_prompts(path, tokenizer, DataConfig()).rows]
    limit = sorted(lengths)[1]
    got = load_prompts(path, tokenizer, DataConfig(max_prompt_length=limit))
    assert got.too_long == sum(n > limit for n in lengths) >= 1
    assert [r["id"] for r in got.rows] == [r["id"] for r, n in zip(ROWS, lengths) if n <= limit]
    assert f"{got.too_long} longer than max_prompt_length dropped" in got.summary()
    with pytest.raises(DatasetError, match="all 4 prompts are longer than data.max_prompt_length=1 tokens"):
        load_prompts(path, tokenizer, DataConfig(max_prompt_length=1))


BAD = [
    {"prompt": "fine"},
    {"question": "no prompt column value"},
    {"prompt": 7},
    {"messages": []},
    {"messages": "not a list"},
    {"messages": [{"role": "user"}]},
    {"prompt": "   "},
]


def test_bad_rows_are_listed_one_line_each(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in BAD))
    with pytest.raises(DatasetError) as err:
        load_prompts(str(path), tokenizer, DataConfig())
    lines = str(err.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["row 1", "row 2", "row 3", "row 4", "row 5", "row 6"]
    assert "no prompt; add a non-empty 'prompt' string" in lines[0]
    assert "'prompt' is a int; it must be a string" in lines[1]
    assert "'messages' is empty" in lines[2] and "'messages' is a str" in lines[3]
    assert "'messages'[0] is not a {role: str, content: str} message" in lines[4]
    assert all(line.startswith(f"{path}: row ") for line in lines)


def test_unusable_files_name_the_field_and_the_fix(tmp_path, tokenizer):
    import datasets

    with pytest.raises(DatasetError, match=r"data.path='.*x.csv': unknown format; use .jsonl, .json, .parquet"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_prompts(str(tmp_path / "x.csv"), tokenizer, DataConfig())
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"prompt": "a"}]), "test": datasets.Dataset.from_list([{"prompt": "b"}])}
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"holds several splits \(train, test\); point at one split's folder"):
        load_prompts(str(tmp_path / "dd"), tokenizer, DataConfig())
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "a"}) + "\n")
    with pytest.raises(DatasetError, match="no 'prompt' or 'messages' column .columns: question.; rename"):
        load_prompts(str(tmp_path / "q.jsonl"), tokenizer, DataConfig())
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl.: line 2 is not JSON \(Expecting value") as err:
        load_prompts(str(tmp_path / "broken.jsonl"), tokenizer, DataConfig())
    assert len(str(err.value).splitlines()) == 1


def test_launcher_lists_bad_rows_and_exits_2_before_any_process_group(tmp_path, tiny_dirs):
    import yaml

    from mgrpo.parallel.distributed import free_port

    model = tiny_dirs("data_qwen2", family="qwen2", num_layers=2)
    data = tmp_path / "bad.parquet"
    import datasets

    datasets.Dataset.from_list(
        [{"prompt": "ok", "messages": None}, {"prompt": None, "messages": []}, {"prompt": None, "messages": None}]
    ).to_parquet(str(data))
    cfg = {"model": {"path": model}, "data": {"path": str(data)}, "logging": {"output_dir": str(tmp_path / "o")}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(
        os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )  # a rank of a 2-process world: init would block if reached
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train_grpo.py"), "--config", str(tmp_path / "c.yaml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert lines == [
        f"error: {data}: row 1: 'messages' is empty; give at least one {{role, content}} message",
        f"error: {data}: row 2: no prompt; add a non-empty 'prompt' string or a 'messages' list (or "
        f"set data.prompt_key / data.messages_key)",
    ], lines
    assert not (tmp_path / "o").exists()


def test_epoch_order_is_fixed_by_the_seed_and_the_position_restores():
    rows = [{"id": i} for i in range(10)]
    ids = lambda batch: [r["id"] for r in batch]  # noqa: E731
    a, b = PromptStream(rows, 4, seed=3), PromptStream(rows, 4, seed=3)
    first = [ids(a.next_batch()) for _ in range(6)]
    assert first == [ids(b.next_batch()) for _ in range(6)]
    assert sorted(sum(first[:5], [])[:10]) == list(range(10))  # each epoch visits every row once
    assert [ids(PromptStream(rows, 4, seed=4).next_batch()) for _ in range(3)] != first[:3]  # negative control
    saved = PromptStream(rows, 4, seed=3)
    for _ in range(3):
        saved.next_batch()
    state = json.loads(json.dumps(saved.state_dict()))  # what a checkpoint stores
    restored = PromptStream(rows, 4, seed=0)
    restored.load_state_dict(state)
    assert [ids(restored.next_batch()) for _ in range(3)] == first[3:]
    with pytest.raises(DatasetError, match="dataset of 10 rows, this one has 9"):
        PromptStream(rows[:9], 4).load_state_dict(state)
    assert ids(PromptStream(rows, 4, shuffle=False).next_batch(6)) == [0, 1, 2, 3, 4, 5]


def test_a_bad_max_tokens_column_is_named(tmp_path, tokenizer):
    """The per-prompt response limit (column max_tokens) is checked at load, not mid-run."""
    path = tmp_path / "limits.jsonl"
    rows = [{"prompt": "a", "max_tokens": 8}, {"prompt": "b", "max_tokens": 0}, {"prompt": "c", "max_tokens": -3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as err:
        load_prompts(str(path), tokenizer, DataConfig())
    lines = str(err.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["row 1", "row 2"]
    assert "max_tokens=0: a positive integer" in lines[0] and "max_tokens=-3" in lines[1]
