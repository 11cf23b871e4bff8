"""Weight sync into SGLang servers through mgrpo's guard (`launch/rollout_server.py --engine sglang`), on CPU.

No SGLang server runs on this CPU (its kernels are CUDA-only), so behind the guard stands `sglang_standin.py`:
SGLang 0.5.23's own weight plane (its request classes, `WeightUpdater.init_weights_update_group` and
`receive_weights_from_distributed`) with no model. What these tests show: the guard's rules (token, ownership,
admin key upstream, the per-bucket and completeness checks that poison); and that a push from a megatron actor at
TP1 and TP2xPP2 (two senders, one per stage) through SGLangCollectiveTransport arrives bit-exact in SGLang's
receiver, in SGLang's call order. Generation and logprob parity against a real SGLang server: test_sglang_gpu.py.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from servers import ROOT, TOKEN, Server, http

KEY = "admin-" + "k" * 24
RUN = "sglang-tests"
STANDIN = os.path.join(ROOT, "tests", "rollout", "sglang_standin.py")
WEIGHT_CALLS = [
    "/pause_generation",
    "/begin_weight_update",
    "/end_weight_update",
    "/flush_cache",
    "/update_weight_version",
    "/continue_generation",
]


class Standin:
    def __init__(self, port: int, dump: str, log: str):
        self.port, self.dump, self.url = port, dump, f"http://127.0.0.1:{port}"
        env = dict(
            os.environ, PYTHONPATH=os.path.join(ROOT, ".sglang"), MGRPO_SGLANG_ADMIN_KEY=KEY, PYTHONWARNINGS="ignore"
        )
        self.proc = subprocess.Popen(
            [sys.executable, STANDIN, "--port", str(port), "--dump", dump],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.time() + 120
        while "standin ready" not in open(log).read():
            assert self.proc.poll() is None and time.time() < deadline, open(log).read()[-3000:]
            time.sleep(0.3)

    def calls(self):
        return json.loads(http(self.url + "/standin/calls", token=KEY)[1])

    def stop(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def env(tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    if not os.path.isdir(os.path.join(ROOT, ".sglang", "sglang")):
        pytest.fail(".sglang/ is missing: run bash scripts/setup.sh (it installs SGLang's package there)")
    model = tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2)
    logs = tmp_path_factory.mktemp("sglang")
    standin = Standin(free_port(), str(logs), str(logs / "standin.log"))
    guards = []

    def guard(**kw):
        g = Server(
            model,
            free_port(),
            str(logs / f"guard{len(guards)}.log"),
            args=["--engine", "sglang", "--sglang-url", standin.url],
            env={"MGRPO_SGLANG_ADMIN_KEY": KEY},
            **kw,
        )
        guards.append(g)
        return g

    yield {"model": model, "standin": standin, "guard": guard(), "new_guard": guard, "logs": logs}
    for g in guards:
        g.stop()
    standin.stop()


def owner_headers(run=RUN):
    return {"x-mgrpo-run": run, "x-mgrpo-attempt": "a1"}


def post(server, path, body, headers=None, token=TOKEN):
    import urllib.error
    import urllib.request

    h = dict({"Authorization": f"Bearer {token}", "Content-Type": "application/json"}, **(headers or {}))
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST", headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_guard_wants_the_token_everywhere_but_health_and_holds_the_admin_key(env):
    g, standin = env["guard"], env["standin"]
    assert g.http("/health", token=None)[0] == 200
    for path in ("/get_server_info", "/mgrpo/version", "/generate", "/flush_cache"):
        assert g.http(path, token=None)[0] == 401 and g.http(path, token="wrong")[0] == 401, path
    status, body = g.http("/get_server_info")  # forwarded with the admin key the client never sees
    assert status == 200 and json.loads(body)["tp_size"] == 1
    assert http(standin.url + "/get_server_info", token=TOKEN)[0] == 401  # SGLang's own port: the admin key only
    info = json.loads(g.http("/mgrpo/version")[1])
    assert info["workers"] == 1 and info["engine"] == "sglang" and info["version"] == 0
    assert post(g, "/pause_generation", {"mode": "retract"})[0] == 409  # state change without a trainer run: refused
    assert g.http("/generate", method="POST", body=b"{}")[0] == 501  # generation passes (the stand-in has no model)


def _push(env, tp: int, pp: int, version: int, run=RUN):
    from mgrpo.parallel.distributed import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(tp * pp),
        "--master-port",
        str(free_port()),
        os.path.join(ROOT, "tests", "rollout", "collective_push.py"),
        "--engine",
        "sglang",
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--model",
        env["model"],
        "--version",
        str(version),
        "--servers",
        env["guard"].url,
        "--run-id",
        run,
    ]
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(clean, MGRPO_SERVER_TOKEN=TOKEN)
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("receipt: "))[9:])


def _checkpoint(model: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(model)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model, f)))
    with open(os.path.join(model, "config.json")) as fh:
        if json.load(fh).get("tie_word_embeddings"):
            out.pop("lm_head.weight", None)
    return out


@pytest.mark.parametrize("tp,pp,version", [(1, 1, 1), (2, 2, 2)])
def test_push_arrives_bit_exact_in_sglangs_receiver(env, tp, pp, version):
    from safetensors.torch import load_file

    before = len(env["standin"].calls())
    receipt = _push(env, tp, pp, version)
    print(receipt)
    assert receipt["servers"] == [env["guard"].url.split("://")[1]] and receipt["senders"] == pp
    got = load_file(os.path.join(env["logs"], f"v{version}.safetensors"))
    want = _checkpoint(env["model"])
    assert sorted(got) == sorted(want)
    assert all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)
    calls = env["standin"].calls()[before:]
    buckets = [c for c in calls if c == "/update_weights_from_distributed"]
    assert len(buckets) == receipt["buckets"] >= pp
    assert [c for c in calls if c in WEIGHT_CALLS] == WEIGHT_CALLS  # SGLang's bracket, flush, version, resume
    if tp * pp == 1:
        assert calls[0] == "/init_weights_update_group"  # first push: the group is opened, then kept
    info = json.loads(env["guard"].http("/mgrpo/version")[1])
    assert info["version"] == version and info["owner"]["run"] == RUN


def test_a_push_lets_generation_in_flight_finish_first(env):
    """Without rollout.partial a push must not mix versions in a response, but SGLang's pause (mode `retract`)
    continues running requests on the new weights. So the push first asks the guard to drain (`/mgrpo/drain`):
    while a generation call is in flight (the stand-in holds it until told), the push waits at the guard and
    SGLang sees no `/pause_generation`; once the call ends, the push goes on, and the guard serves generation again
    after `/continue_generation`. Negative control: a pause sent straight through the guard, with no drain,
    reaches SGLang while the call is still running."""
    import threading

    g, standin, logs = env["guard"], env["standin"], env["logs"]
    hold, release = os.path.join(logs, "generate-hold"), os.path.join(logs, "generate-release")

    def state():
        return json.loads(g.http("/mgrpo/version")[1])

    def generating(action) -> list:
        """The stand-in's calls while one generation call is held and `action(before)` runs, then the call ends."""
        before, answers = len(standin.calls()), []
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
        worker = threading.Thread(target=lambda: answers.append(post(g, "/generate", body)))
        open(hold, "w").close()
        try:
            worker.start()
            deadline = time.time() + 30
            while state()["generating"] < 1:
                assert time.time() < deadline, "the generation call never reached the guard"
                time.sleep(0.05)
            action(before)
        finally:
            open(release, "w").close()
            worker.join(timeout=60)
            os.unlink(hold)
            os.unlink(release)
        assert answers and answers[0][0] == 200, answers
        return standin.calls()[before:]

    def push_while_held(before):
        pusher = threading.Thread(target=lambda: _push(env, 1, 1, 3))
        pusher.start()
        deadline = time.time() + 120
        while not state()["draining"]:
            assert time.time() < deadline and pusher.is_alive(), "the push never reached the guard's drain"
            time.sleep(0.05)
        time.sleep(0.5)
        assert "/pause_generation" not in standin.calls()[before:], "SGLang paused while a call was in flight"
        open(release, "w").close()
        pusher.join(timeout=300)

    calls = generating(push_while_held)
    print(f"with the drain: {calls}")
    assert calls.index("/generate done") < calls.index("/pause_generation"), calls
    assert state()["version"] == 3 and not state()["draining"]

    def pause_and_continue(before):
        for path, body in (("/pause_generation", {"mode": "retract"}), ("/continue_generation", {})):
            assert post(g, path, body, owner_headers())[0] == 200

    calls = generating(pause_and_continue)
    print(f"without: {calls}")
    assert calls.index("/pause_generation") < calls.index("/generate done"), "negative control"


def test_an_interrupt_ends_calls_in_flight_as_interrupted(env):
    """A checkpoint of a partial run on SGLang (rollout.partial with recompute_kv_after_update): the guard's
    POST /mgrpo/interrupt pauses SGLang with mode `abort` and resumes it; the call in flight (held by the stand-in)
    ends with the token it had, its answer marked `x-mgrpo-interrupted`, which the client reads as "interrupted"
    (the manager then continues it from its prefix). A call answered without an interrupt stays "length"."""
    import threading

    import httpx

    from mgrpo.rollout.engines.sglang import SGLangEngine

    g, standin, hold = env["guard"], env["standin"], os.path.join(env["logs"], "generate-hold")
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    engine = SGLangEngine.__new__(SGLangEngine)  # only its parser: no replicas needed
    answers = []

    def generate():
        r = httpx.post(g.url + "/generate", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        answers.append((r.status_code, r.json(), r.headers))

    open(hold, "w").close()
    try:
        worker = threading.Thread(target=generate)
        worker.start()
        deadline = time.time() + 30
        while json.loads(g.http("/mgrpo/version")[1])["generating"] < 1:
            assert time.time() < deadline
            time.sleep(0.05)
        before = len(standin.calls())
        status, receipt = post(g, "/mgrpo/interrupt", {}, owner_headers())
        worker.join(timeout=60)
    finally:
        os.unlink(hold)
    assert status == 200 and receipt == {"interrupted_requests": 1}, receipt
    calls = standin.calls()[before:]
    assert calls.index("/pause_generation") < calls.index("/generate done") and "/continue_generation" in calls
    code, data, headers = answers[0]
    out = engine.parse_response(data, headers, g.url)
    print(f"interrupted through the guard: {out}")
    assert code == 200 and out.finish_reason == "interrupted" and out.token_ids == [7]
    plain = engine.parse_response(
        dict(data, meta_info=dict(data["meta_info"], finish_reason={"type": "length"})), {}, ""
    )
    assert plain.finish_reason == "length", "negative control: no interrupt, no interrupted"


def test_another_run_is_refused_and_a_version_without_an_update_too(env):
    g = env["guard"]
    status, body = post(g, "/begin_weight_update", {}, owner_headers("someone-else"))
    assert status == 409 and "another trainer" in body["error"]
    v = json.loads(g.http("/mgrpo/version")[1])["version"]
    status, body = post(
        g, "/update_weight_version", {"new_version": str(v + 1), "abort_all_requests": False}, owner_headers()
    )
    assert status == 409 and "no update in progress" in body["error"]
    assert g.http("/health", token=None)[0] == 200  # refused, not poisoned: nothing was loaded
    assert json.loads(g.http("/mgrpo/version")[1])["version"] == v


def test_an_unknown_tensor_poisons_before_sglang_sees_it(env):
    g = env["new_guard"]()
    h = owner_headers("poison-run")
    assert post(g, "/begin_weight_update", {}, h)[0] == 200
    status, body = post(
        g,
        "/update_weights_from_distributed",
        {
            "names": ["model.layers.0.mlp.not_a_weight"],
            "dtypes": ["float32"],
            "shapes": [[4]],
            "group_name": "x",
            "load_format": "flattened_bucket",
            "flush_cache": False,
        },
        h,
    )
    assert status == 400 and "unknown tensor" in body["error"]
    assert g.http("/health", token=None)[0] == 503
    assert "unknown tensor" in json.loads(g.http("/mgrpo/version")[1])["poisoned"]
    assert g.http("/generate", method="POST", body=b"{}")[0] == 503


def test_an_incomplete_version_is_refused_and_poisons(env):
    g = env["new_guard"]()
    h = owner_headers("incomplete-run")
    before = json.loads(g.http("/mgrpo/version")[1])["version"]  # what the SGLang behind it holds
    assert post(g, "/begin_weight_update", {}, h)[0] == 200
    status, body = post(g, "/update_weight_version", {"new_version": "50", "abort_all_requests": False}, h)
    assert status == 409 and "incomplete" in body["error"]
    assert json.loads(g.http("/mgrpo/version")[1])["version"] == before
    assert g.http("/health", token=None)[0] == 503


def test_a_server_killed_mid_broadcast_is_excluded_and_rejoins(single_rank, env, tmp_path):
    """Two SGLang servers; the second's stand-in is SIGKILLed while it waits to receive a bucket: the push fails
    there within the timeout, the first takes the version, the second is excluded; restarted (its start weights,
    version 0 again) it gets new groups and the whole model at the next push."""
    import threading

    from engine_helpers import trainer_actor

    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.parallel.distributed import free_port
    from mgrpo.rollout.engines.sglang import SGLangEngine
    from mgrpo.weights.transports.collective_sglang import SGLangCollectiveTransport

    b_dump = tmp_path / "b"
    b_dump.mkdir()
    b_port = free_port()
    b = Standin(b_port, str(b_dump), str(tmp_path / "standin_b.log"))
    guard_b = Server(
        env["model"],
        free_port(),
        str(tmp_path / "guard_b.log"),
        args=["--engine", "sglang", "--sglang-url", b.url],
        env={"MGRPO_SGLANG_ADMIN_KEY": KEY},
    )
    guards = [env["guard"], guard_b]
    try:
        engine = SGLangEngine(
            [g.url for g in guards], TOKEN, load_tokenizer(env["model"]).eos_token_id, run_id=RUN, take_over=True
        )
        transport = SGLangCollectiveTransport(engine, 1 << 20, timeout_s=30)
        actor = trainer_actor(env["model"])
        assert transport.send_model(actor.models(), 10)["servers"] == sorted(g.url[7:] for g in guards)
        (b_dump / "receive-delay").write_text("4")
        killer = threading.Timer(2.0, b.stop)
        killer.start()
        t0 = time.time()
        receipt = transport.send_model(actor.models(), 11)
        took = time.time() - t0
        killer.join()
        why = engine.replicas[1].last_error
        print(f"killed mid-broadcast: {took:.1f} s, receipt servers {receipt['servers']}; {guard_b.url}: {why[:300]}")
        assert receipt["servers"] == [guards[0].url[7:]] and not engine.replicas[1].up and took < 30
        assert "not applied" in why
        (b_dump / "receive-delay").unlink()
        b = Standin(b_port, str(b_dump), str(tmp_path / "standin_b2.log"))  # restarted: version "0", no groups
        assert json.loads(guard_b.http("/mgrpo/version")[1])["version"] == 0
        receipt = transport.send_model(actor.models(), 12)
        assert receipt["servers"] == sorted(g.url[7:] for g in guards)
        assert [json.loads(g.http("/mgrpo/version")[1])["version"] for g in guards] == [12, 12]
        from safetensors.torch import load_file

        got, want = load_file(str(b_dump / "v12.safetensors")), _checkpoint(env["model"])
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
        transport.close()
    finally:
        guard_b.stop()
        b.stop()


def test_the_launcher_refuses_unsafe_or_impossible_sglang_setups(env, tmp_path):
    """One line and exit 2 for what a user can fix; exit 1 with SGLang's own last words when it cannot start."""
    base = [
        sys.executable,
        os.path.join(ROOT, "launch", "rollout_server.py"),
        "--engine",
        "sglang",
        "--model",
        env["model"],
        "--port",
        "1",
    ]
    clean = {
        k: v for k, v in os.environ.items() if k not in ("MGRPO_SGLANG_ADMIN_KEY", "SGLANG_RETURN_ORIGINAL_LOGPROB")
    }
    cases = [
        (["--sglang-url", "http://10.1.2.3:30000"], {}, 2, "is not on loopback"),
        (["--sglang-url", "http://127.0.0.1:30000"], {}, 2, "MGRPO_SGLANG_ADMIN_KEY"),
        ([], {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, 2, "unset it"),
        ([], {}, 1, "SGLang exited"),
    ]  # no SGLang in the trainer's venv: its own error comes back
    for extra, more, code, words in cases:
        r = subprocess.run(
            base + extra, capture_output=True, text=True, timeout=120, env=dict(clean, MGRPO_SERVER_TOKEN=TOKEN, **more)
        )
        print(extra, more, r.returncode, r.stderr.strip().splitlines()[-1:])
        assert r.returncode == code and words in r.stderr, r.stderr[-2000:]
