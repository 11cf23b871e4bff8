"""Multi-turn rollout throughput, side by side on the same gym trajectories (guess the number, 3 turns, tiny
model, fp32, CPU): turns coalesced into shared engine calls vs one engine call per turn, on the HF engine and on
the colocated vLLM engine (`TurnClient` picks coalescing for HF and one call per turn for vLLM from these). Also the engine-side peak of requests in flight against
`max_concurrent`, and peak RSS of this process and of the vLLM engine process.

    .venv/bin/python benchmarks/multi_turn.py [--trajectories 256] [--max-concurrent 32] [--skip-vllm]

Ends with `result: hf_coalesced_speedup=X vllm_coalesced_speedup=Y vllm_vs_hf=Z vllm_peak_inflight=P ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mgrpo.data.dataset import encode_prompt  # noqa: E402
from mgrpo.data.tokenizer import load_tokenizer  # noqa: E402
from mgrpo.models.tiny import make_tiny_hf  # noqa: E402
from mgrpo.rollout.multiturn import multi_turns  # noqa: E402
from mgrpo.rollout.multiturn.driver import TurnClient, run_trajectories  # noqa: E402
from mgrpo.rollout.multiturn.types import InferRequest  # noqa: E402
from mgrpo.rollout.types import SamplingParams  # noqa: E402


def run(engine, tok, n: int, bound: int, coalesce: bool) -> tuple:
    sch = multi_turns["gym"](None, 3, tokenizer=tok, gym_env="guess_number")
    sch.infer_engine = client = TurnClient(engine, tok, 600, coalesce=coalesce)
    msgs = [{"role": "user", "content": "x"}]
    reqs = [
        InferRequest(
            messages=[dict(m) for m in msgs],
            data_dict={"target": 1 + i % 20},
            uuid=f"u{i}",
            prompt_ids=encode_prompt(tok, msgs),
            seed=i,
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    outs = asyncio.run(run_trajectories(sch, reqs, SamplingParams(temperature=1.0, max_tokens=8), bound))
    seconds = time.perf_counter() - t0
    failed = [o for o in outs if isinstance(o, BaseException)]
    if failed:
        raise failed[0]
    tokens = sum(sum(o.response_loss_mask) for o in outs)
    return seconds, tokens, client.calls, sum(o.rollout_infos["num_turns"] for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--max-concurrent", type=int, default=32)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    from mgrpo.rollout.engines.hf import HFEngine

    model = make_tiny_hf(os.path.join(tempfile.mkdtemp(prefix="mgrpo-bench-"), "tiny"), num_layers=4)
    tok = load_tokenizer(model)
    engines = {"hf": HFEngine(model, tok.eos_token_id, tok.pad_token_id)}
    if not args.skip_vllm:
        from mgrpo.rollout.engines.vllm import VLLMEngine

        engines["vllm"] = VLLMEngine(model, eos_token_id=tok.eos_token_id, max_num_seqs=256)
    n, bound, res = args.trajectories, args.max_concurrent, {}
    print(f"{n} gym trajectories x 3 turns x <= 8 tokens, max_concurrent={bound}\n")
    print(f"{'engine':8} {'turns':14} {'seconds':>8} {'model tok/s':>12} {'engine calls':>13} {'peak in flight':>15}")
    for name, engine in engines.items():
        engine.name = f"{name}#0"
        for coalesce in (True, False):
            engine.stats(reset=True)
            seconds, tokens, calls, turns = run(engine, tok, n, bound, coalesce)
            peak = engine.stats()["requests_peak"]
            res[(name, coalesce)] = seconds
            auto = coalesce == (name == "hf")
            label = ("coalesced" if coalesce else "one call each") + (" *" if auto else "")
            print(f"{name:8} {label:14} {seconds:8.2f} {tokens / seconds:12.0f} {calls:13d} {peak:15d}")
            if name == "vllm" and not coalesce:
                res["vllm_peak"] = peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    line = [f"hf_coalesced_speedup={res[('hf', False)] / res[('hf', True)]:.2f}"]
    if "vllm" in engines:
        with open(f"/proc/{engines['vllm'].pid}/status") as f:
            hwm = next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) / 1024
        line += [
            f"vllm_coalesced_speedup={res[('vllm', False)] / res[('vllm', True)]:.2f}",
            f"vllm_vs_hf={res[('hf', True)] / res[('vllm', False)]:.2f}",
            f"vllm_peak_inflight={res['vllm_peak']}",
            f"vllm_seconds={res[('vllm', False)]:.2f}",
            f"engine_peak_rss_mb={hwm:.0f}",
        ]
        engines["vllm"].close()
    line += [f"max_concurrent={bound}", f"driver_peak_rss_mb={rss:.0f}"]
    print("\n* what TurnClient does by default (coalesce for engines that compute inline, not for async ones)")
    print("\nresult: " + " ".join(line))


if __name__ == "__main__":
    main()
