"""Who may update a rollout server (serving/ownership.py): the first run claims it; another run only by taking over
(logged); versions strictly increase within a process; a resumed process of the same run replaces the old one,
which is refused from then on. The same rules against a real server: tests/rollout/test_remote_faults.py."""
from mgrpo.rollout.serving.ownership import Ownership


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
