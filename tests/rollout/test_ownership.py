"""Who may update a rollout server (serving/ownership.py): the first run claims it; another run only by taking over
(logged); versions strictly increase within a process; a resumed process of the same run replaces the old one,
which is refused from then on. The same rules against a real server: tests/rollout/test_remote_faults.py."""

from mgrpo.serving.ownership import Ownership


def test_the_rules():
    logged = []
    own = Ownership(log=logged.append)
    assert own.refusal("runA", "p1", 0) is None  # first claim, any version
    own.committed(0)
    assert own.refusal("runA", "p1", 1) is None
    own.committed(1)
    assert "not newer than version 1" in own.refusal("runA", "p1", 1)  # no rollback, no replay
    assert "not newer" in own.refusal("runA", "p1", 0)
    assert "another trainer" in own.refusal("runB", "q1", 9)  # a second trainer
    assert own.state() == {"run": "runA", "attempt": "p1", "last_committed": 1}
    assert own.refusal("runB", "q1", 0, take_over=True) is None  # take-over: logged, any version
    assert "takes the server over from run runA" in logged[-1]
    own.committed(0)
    assert "another trainer" in own.refusal("runA", "p1", 5)  # the old owner is now the foreign one
    assert own.refusal("runB", "q2", 0) is None  # runB resumed from its checkpoint: version 0 again
    assert "resumed" in logged[-1]
    assert "replaced by a resumed process" in own.refusal("runB", "q1", 7)  # the requeued job's stale process
    for bad in ("", "x" * 65, "caf\u00e9", "a\nb"):
        assert "x-mgrpo-run" in own.refusal(bad, "p", 1)
    assert own.state()["run"] == "runB"


def test_a_resumed_run_keeps_its_run_id(tmp_path):
    """rollout.remote.run_id: random for a fresh run; --resume takes the checkpoint's (its config.yaml), so the
    servers see the same run and accept the checkpoint's version again."""
    import os

    import yaml

    from mgrpo.config import load_config, to_dict
    from mgrpo.rollout.engines.remote import run_identity

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = ["--rollout.engine", "remote", "--rollout.servers", "http://127.0.0.1:1"]
    fresh = [
        run_identity(load_config(os.path.join(root, "examples", "tiny_cpu.yaml"), args, check_files=False))
        for _ in range(2)
    ]
    assert fresh[0] != fresh[1] and len(fresh[0]) == 16
    saved = load_config(os.path.join(root, "examples", "tiny_cpu.yaml"), args, check_files=False)
    saved.rollout.remote.run_id = "run-from-ckpt"
    (tmp_path / "step_000004").mkdir()
    (tmp_path / "step_000004" / "config.yaml").write_text(yaml.safe_dump(to_dict(saved)))
    resumed = load_config(
        os.path.join(root, "examples", "tiny_cpu.yaml"),
        args + ["--checkpoint.resume", str(tmp_path / "step_000004")],
        check_files=False,
    )
    assert run_identity(resumed) == "run-from-ckpt" == resumed.rollout.remote.run_id
    pinned = load_config(
        os.path.join(root, "examples", "tiny_cpu.yaml"), args + ["--rollout.remote.run_id", "mine"], check_files=False
    )
    assert run_identity(pinned) == "mine"
