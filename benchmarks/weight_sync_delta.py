"""The delta rows of benchmarks/weight_sync.py: full vs delta HTTP pushes of a bf16 model trained real steps.

An ~85M Qwen2 (vs_trl.py's mid size) is trained with HF transformers and AdamW (fp32 master weights, LM loss on the
tiny prompts) at LR 1e-6 and 1e-5; after each step its bf16 copy goes to a guarded vLLM server (`--dtype bfloat16`)
twice with the same HTTP transport (`rollout.remote.delta: true, full_every: 2`): first as a delta against the
previous step (odd versions), then whole (even versions, which also keep the server's base for the next delta). So
each step has a full and a delta push of the same weights to the same server, in one run. Both are timed on
loopback (~1.1 GB/s here: about a 10 Gb/s link already) and on an emulated 1 Gb/s link (the client's sends paced to
0.125 GB/s), where the wire's share of a full push matches a 72B push over 25 Gb/s Ethernet (~48 s of wire against
~7 s of load: the ~85M model's 171 MB over 1 Gb/s is 1.4 s against its 0.12 s load; a rollout server on another
machine), and split into export/encode, transfer, the server's in-place apply and vLLM's reload.
Bytes: the dense bf16 tensors, the XOR+zstd wire bytes, and what indices (int32) + values would have cost.

    .venv/bin/python benchmarks/weight_sync.py --delta-only
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "examples", "data", "tiny_prompts.jsonl")
LINKS = {"loopback": None, "1 Gb/s (emulated)": 0.125e9}


class Paced:
    """The emulated link: http.client's sends while active go through a FIFO link of `rate` bytes/s with a send
    buffer of BUFFER bytes. Each send joins the queue when it is handed over, and the link carries the queue back
    to back; the sender waits only while more than BUFFER bytes are queued; a response is read only once
    everything sent has crossed (the server cannot answer bytes it has not had). So time the sender spends
    before a send, coding the next bucket, is not bandwidth: before 2026-12-08 the pacing counted from the push's
    start, which gave a delta's few MB their wire time free during the encode."""

    BUFFER = 4 << 20  # Linux's default largest TCP send buffer (net.ipv4.tcp_wmem)

    def __init__(self, rate: float | None):
        self.rate = rate
        self.originals = http.client.HTTPConnection.send, http.client.HTTPConnection.getresponse

    def __enter__(self):
        if self.rate:
            free_at, (send_, getresponse_), rate = [0.0], self.originals, self.rate

            def wait_until(t):
                if t > time.perf_counter():
                    time.sleep(t - time.perf_counter())

            def send(conn, data):
                n = len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes
                free_at[0] = max(free_at[0], time.perf_counter()) + n / rate  # queued now, crossed then
                out = send_(conn, data)
                wait_until(free_at[0] - self.BUFFER / rate)
                return out

            def getresponse(conn):
                wait_until(free_at[0])
                return getresponse_(conn)

            http.client.HTTPConnection.send, http.client.HTTPConnection.getresponse = send, getresponse
        return self

    def __exit__(self, *exc):
        http.client.HTTPConnection.send, http.client.HTTPConnection.getresponse = self.originals


def training_batches(model_dir: str, n: int = 8, length: int = 64):
    import torch

    from mgrpo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    rows = [json.loads(line) for line in open(PROMPTS)]
    texts = [r.get("prompt") or r["messages"][-1]["content"] for r in rows]
    ids = [tok.encode(" ".join(texts[i : i + 20]))[:length] for i in range(0, len(texts), 20)]
    ids = [x + [0] * (length - len(x)) for x in ids if x][:n]
    return torch.tensor(ids)


def run(
    model_dir: str,
    port: int,
    token: str,
    lrs=(1e-6, 1e-5),
    steps: int = 3,
    bucket_bytes: int = 64 << 20,
    save_dir: str | None = None,
) -> tuple:
    """(figures for the result line, {lr: [weight folders, one per training step, the untrained one first]} when
    `save_dir` is given (bf16 safetensors, for the collective rows), the last version pushed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.rollout.engines.remote import RemoteEngine

    engine = RemoteEngine(
        [f"http://127.0.0.1:{port}"],
        token,
        load_tokenizer(model_dir).eos_token_id,
        update_timeout_s=1200,
        run_id="benchmark-delta",
        take_over=True,
        delta=True,
        full_every=2,
    )
    batch = training_batches(model_dir)
    rows, version, saved = [], 0, {}
    for lr in lrs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        transport = engine.weight_transport(bucket_bytes)
        version += 2 - version % 2  # even: a full push that leaves the base

        def weights():
            return [(n, p.detach().to(torch.bfloat16)) for n, p in model.state_dict().items()]

        def save():
            if save_dir is None:
                return
            from safetensors.torch import save_file

            folder = os.path.join(save_dir, f"lr{lr:.0e}-{len(saved.setdefault(lr, [])):02d}")
            os.makedirs(folder)
            tied = model.config.tie_word_embeddings
            save_file(
                {n: t for n, t in weights() if not (tied and n == "lm_head.weight")}, f"{folder}/model.safetensors"
            )
            saved[lr].append(folder)

        save()
        transport.send(iter(weights()), version)
        for step in range(1, steps + 1):
            for link, rate in LINKS.items():  # a real training step for each link, so each delta is one step's
                loss = model(input_ids=batch, labels=batch).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                for kind in ("delta", "full"):
                    version += 1
                    assert (version % 2 == 1) == (kind == "delta")
                    t0 = time.perf_counter()
                    with Paced(rate):
                        r = transport.send(iter(weights()), version)
                    total_s = time.perf_counter() - t0  # the push; the check below is not part of it
                    d = r["delta"]
                    digest = engine.get(engine.replicas[0], "/mgrpo/weights_digest")["workers"][0]["digest"]
                    rows.append(
                        dict(
                            lr=lr,
                            step=step,
                            link=link,
                            kind=kind,
                            total_s=total_s,
                            export_s=r["export_s"],
                            transfer_s=r["transfer_s"],
                            apply_s=d["apply_s"],
                            load_s=r["load_s"],
                            bytes=r["bytes"],
                            dense_bytes=d["dense_bytes"],
                            changed=d["changed"] / max(d["elements"], 1),
                            idx_val_bytes=d["changed"] * (4 + 2),
                            delta_servers=len(d["servers"]),
                            base_host_bytes=d["base_host_bytes"],
                            digest=digest,
                        )
                    )
                save()  # after the step's pushes: its writes would compete with their encode
        transport.close()
    engine.close()
    return summarize(rows), saved, version


def summarize(rows: list) -> dict:
    print(
        f"\n{'LR':>6} {'step':>4} {'link':20} {'push':6} {'changed':>8} {'bytes MB':>9} {'of dense':>9} "
        f"{'idx+val':>8} {'total s':>8} {'encode s':>9} {'transfer s':>11} {'apply s':>8} {'load s':>7}"
    )
    for r in rows:
        print(
            f"{r['lr']:6.0e} {r['step']:4d} {r['link']:20} {r['kind']:6} {r['changed']:8.3f} "
            f"{r['bytes'] / 1e6:9.1f} {r['bytes'] / r['dense_bytes']:9.3f} {r['idx_val_bytes'] / r['dense_bytes']:8.3f} "
            f"{r['total_s']:8.2f} {r['export_s']:9.2f} {r['transfer_s']:11.2f} {r['apply_s']:8.2f} {r['load_s']:7.2f}"
        )
    out = {}
    for lr in sorted({r["lr"] for r in rows}):
        deltas = [r for r in rows if r["lr"] == lr and r["kind"] == "delta"]
        out[f"delta_bytes_frac_{lr:.0e}"] = statistics.median(r["bytes"] / r["dense_bytes"] for r in deltas)
        out[f"idx_val_bytes_frac_{lr:.0e}"] = statistics.median(r["idx_val_bytes"] / r["dense_bytes"] for r in deltas)
        for link, key in (("loopback", "http"), ("1 Gb/s (emulated)", "http_1gbps")):
            full = statistics.median(
                r["total_s"] for r in rows if r["lr"] == lr and r["kind"] == "full" and r["link"] == link
            )
            delta = statistics.median(
                r["total_s"] for r in rows if r["lr"] == lr and r["kind"] == "delta" and r["link"] == link
            )
            out[f"delta_{key}_speedup_{lr:.0e}"] = full / delta
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if a["kind"] == "delta" and b["kind"] == "full"]
    same = sum(a["digest"] == b["digest"] for a, b in pairs)
    print(
        f"bf16 engine: its parameters after each delta push equal those after the full push of the same weights "
        f"(xxh3 of every vLLM parameter): {same}/{len(pairs)}"
    )
    out["delta_bitwise_pairs"] = same / max(len(pairs), 1)
    base = max(r["base_host_bytes"] for r in rows)
    print(f"sender's delta base: {base / 2**20:.0f} MiB of host memory (one bf16 copy of what it sends)")
    for k, v in out.items():
        print(f"{k}: {v:.3f}")
    return out


if __name__ == "__main__":
    sys.exit("run it through benchmarks/weight_sync.py --delta-only")
