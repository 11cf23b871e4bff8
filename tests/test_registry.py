"""One registry helper behind every name -> object table (mgrpo/registry.py): a duplicate name fails naming both
places, a plugin replaces a built-in only with override=True, built-ins are always there before a plugin's name."""

import os

import pytest

from mgrpo.registry import DuplicateNameError, Registry


def first():
    return 1


def second():
    return 2


def test_a_duplicate_name_names_both_places():
    reg = Registry("widget")
    reg.register("w")(first)
    reg.register("w")(first)  # the same object again (a module imported twice): no change
    with pytest.raises(DuplicateNameError) as exc:
        reg.register("w")(second)
    here = os.path.relpath(__file__)
    line = {f: f.__code__.co_firstlineno for f in (first, second)}
    assert str(exc.value) == (
        f"widget 'w' is registered twice: at {here}:{line[first]} and at {here}:{line[second]}; register yours under "
        f"another name, or pass override=True to replace the first"
    )
    assert reg.lookup("w") is first
    reg.register("w", override=True)(second)
    assert reg.lookup("w") is second and reg.where("w") == f"{here}:{line[second]}"


def test_an_unknown_name_lists_the_known_ones():
    reg = Registry("widget", aliases={"old": "w"})
    reg["w"] = first  # ms-swift's dict idiom
    assert reg.lookup("old") is first
    with pytest.raises(KeyError, match=r"rollout.widget='x': no widget of that name is registered; known: old, w"):
        reg.lookup("x", "rollout.widget")


@pytest.mark.parametrize(
    "module,name,builtin",
    [
        ("mgrpo.rewards.registry", "REWARDS", "accuracy"),
        ("mgrpo.rollout.engine", "ENGINES", "vllm"),
        ("mgrpo.models.registry", "FAMILIES", "qwen3_moe"),
        ("mgrpo.rollout.multiturn.registry", "multi_turns", "tool_call"),
        ("mgrpo.rollout.multiturn.registry", "envs", "guess_number"),
        ("mgrpo.loss.registry", "POLICY_LOSSES", "gspo"),
        ("mgrpo.loss.registry", "ADVANTAGES", "rloo"),
        ("mgrpo.loss.kl", "KL_ESTIMATORS", "k3"),
    ],
)
def test_every_table_is_one_registry_with_its_builtins(module, name, builtin):
    import importlib

    reg = getattr(importlib.import_module(module), name)
    assert isinstance(reg, Registry)
    assert builtin in reg.names()


@pytest.fixture
def restore_accuracy():
    from mgrpo.rewards.registry import REWARDS

    spec, where = REWARDS.lookup("accuracy"), REWARDS.where("accuracy")
    yield REWARDS
    REWARDS.add("accuracy", spec, override=True, where=where)


def test_a_plugin_overrides_accuracy_only_by_saying_so(tmp_path, restore_accuracy):
    """The built-in is registered before the plugin's file runs (it cannot be overwritten later by a lazy load)."""
    from mgrpo.plugins import PluginError, load_plugins

    rewards = restore_accuracy
    builtin = rewards.lookup("accuracy").fn
    silent = tmp_path / "silent.py"
    silent.write_text(
        "from mgrpo.rewards import register_reward\n\n\n@register_reward('accuracy', per_sample=True)\n"
        "def accuracy(completion, **_):\n    return 1.0\n"
    )
    with pytest.raises(PluginError) as exc:
        load_plugins([str(silent)])
    message = str(exc.value)
    assert "raised DuplicateNameError: reward 'accuracy' is registered twice: at mgrpo/rewards/outcome.py:" in message
    assert f"{silent.name}:4; register yours under another name, or pass override=True" in message
    assert rewards.lookup("accuracy").fn is builtin

    loud = tmp_path / "loud.py"
    loud.write_text(
        "from mgrpo.rewards import register_reward\n\n\n@register_reward('accuracy', per_sample=True, "
        "override=True)\ndef accuracy(completion, **_):\n    return 1.0\n"
    )
    load_plugins([str(loud)])
    assert rewards.lookup("accuracy").fn is not builtin
    assert rewards.lookup("accuracy").fn("anything") == 1.0
