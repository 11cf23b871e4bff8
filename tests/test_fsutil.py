"""Atomic folder replacement (checkpoints, HF exports): a kill at any point leaves a complete folder."""

import os

import pytest

from mgrpo import fsutil
from mgrpo.fsutil import replace_dir


def _folder(path, text):
    os.makedirs(path)
    with open(os.path.join(path, "weights"), "w") as f:
        f.write(text)


def _read(path):
    with open(os.path.join(path, "weights")) as f:
        return f.read()


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_swaps_in_the_new_folder_and_deletes_the_old(tmp_path, exchange):
    _folder(tmp_path / "out", "old")
    _folder(tmp_path / "out.tmp", "new")
    replace_dir(str(tmp_path / "out.tmp"), str(tmp_path / "out"), exchange=exchange)
    assert _read(tmp_path / "out") == "new" and sorted(os.listdir(tmp_path)) == ["out"]
    _folder(tmp_path / "fresh.tmp", "x")
    replace_dir(str(tmp_path / "fresh.tmp"), str(tmp_path / "fresh"), exchange=exchange)
    assert _read(tmp_path / "fresh") == "x"


def test_atomic_exchange_is_available_here(tmp_path):
    _folder(tmp_path / "a", "a")
    _folder(tmp_path / "b", "b")
    assert fsutil._exchange(str(tmp_path / "a"), str(tmp_path / "b"))
    assert _read(tmp_path / "a") == "b" and _read(tmp_path / "b") == "a"


class Killed(BaseException):
    pass


@pytest.mark.parametrize("kill_at", ["exchange", "first_rename", "second_rename", "delete"])
def test_a_kill_at_any_step_leaves_a_complete_folder(tmp_path, monkeypatch, kill_at):
    _folder(tmp_path / "out", "old")
    _folder(tmp_path / "out.tmp", "new")
    calls = {"replace": 0}
    real_replace, real_rmtree = os.replace, fsutil.shutil.rmtree

    def replace(a, b):
        calls["replace"] += 1
        if (kill_at, calls["replace"]) in (("first_rename", 1), ("second_rename", 2)):
            raise Killed()
        return real_replace(a, b)

    def rmtree(*a, **k):
        if kill_at == "delete":
            raise Killed()
        return real_rmtree(*a, **k)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    monkeypatch.setattr(fsutil.shutil, "rmtree", rmtree)
    if kill_at == "exchange":
        monkeypatch.setattr(fsutil, "_exchange", lambda a, b: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        replace_dir(str(tmp_path / "out.tmp"), str(tmp_path / "out"), exchange=kill_at in ("exchange", "delete"))
    # the old order (delete, then rename) fails this at "first_rename": no complete folder is left anywhere
    where = {p: _read(tmp_path / p) for p in os.listdir(tmp_path)}
    assert where.get("out") in ("old", "new") or any(
        p.startswith("out.old-") and v == "old" for p, v in where.items()
    ), where
