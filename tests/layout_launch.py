"""One set of torchrun launches shared by the layout-matrix and resharding tests (a launch costs 7-11 s).

Each launch runs several layouts in turn; the TP1 reference runs in the pytest process itself.
"""

import os
import subprocess
import sys

import torch
from layout_check import run_export_roundtrip, run_layout

from mgrpo.config import load_config
from mgrpo.parallel.distributed import free_port
from mgrpo.rollout.types import Sample, samples_to_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "parallel", "layout_worker.py")

LAUNCHES = {
    2: [
        "tp2",
        "tp2-sp",
        "pp2",
        "pp2-vpp2",
        "dp2",
        "dp2-distopt",
        "tp2-wrongshard",
        "dp2-distopt-nogloo",
        "tp2-nogloo",
        "dp2-topent",
        "cp2-topent",
        "pp2-topent",
        "dp2-topent-rankq",
        "dp2-loss_sapo",
        "cp2-loss_sapo",
        "roundtrip:tp2",
        "roundtrip:pp2",
        "roundtrip:pp2-vpp2",
        "tp2-loss_grpo",
        "pp2-vpp2-loss_grpo",
        "dp2-loss_dr_grpo",
        "pp2-loss_gspo",
        "dp2-loss_cispo",
        "cp2",
        "cp2-loss_gspo",
        "cp2-loss_gspo-localseq",
        "cp2-nozigzag",
    ],
    4: [
        "mb2:tp2-pp2",
        "mb4:tp2-pp2",
        "nanstep:tp2-pp2",
        "nanstep_noguard:tp2-pp2",
        "ckpt:tp2-pp2",
        "tp2-pp2-vpp2-sp",
        "roundtrip:tp2-pp2",
        "initexport:tp2-pp2",
        "tp2-dp2-loss_grpo",
        "tp2-dp2-loss_gspo",
        "tp2-cp2",
        "dp2-cp2",
        "pp2-cp2",
        "tp2-cp2-loss_gspo",
        "dp2-cp2-loss_gspo",
        "pp2-cp2-loss_gspo",
    ],
    8: ["tp2-pp2-dp2", "tp2-pp2-dp2-distopt"],
}
# LoRA (rank 4 on all seven HF linears, adapters from HF+PEFT with a random B) against a TP1 LoRA run in-process;
# tp2-loraswap is the negative control (each TP rank holds another rank's shard of layer 0's q_proj B).
LAUNCHES[2] += ["lora:tp2", "lora:tp2-sp", "lora:pp2", "lora:tp2-loraswap"]
LAUNCHES[4] += ["lora:tp2-pp2", "lora:tp2-dp2-distopt", "lora:tp2-pp2-vpp2-sp"]
# Sequence packing and token-budget micro-batches (DP-balanced) against the padded TP1 run; cp2-pack-crossattn is the
# negative control (CP attention across the samples of a packed row).
LAUNCHES[2] += [
    "tp2-pack",
    "tp2-sp-pack",
    "cp2-pack",
    "cp2-pack-loss_gspo",
    "pp2-pack-budget48",
    "dp2-pack-budget48",
    "dp2-budget48",
    "cp2-pack-crossattn",
]
LAUNCHES[4] += ["tp2-cp2-pack", "tp2-dp2-pack-budget40"]
LAUNCHES[2].append(LAUNCHES[2].pop(LAUNCHES[2].index("cp2-nozigzag")))  # last: it patches the CP split for good
LORA_ARGS = ["--model.lora.rank", "4", "--model.lora.alpha", "8"]
LORA_ADAPTER = "lora_adapter.safetensors"  # in the launch's output folder
# Qwen3-MoE (8 experts, top-2, a dense layer among sparse ones): EP2 (DP2), TP2xEP2 (SP: megatron needs it with
# MoE and TP; it also saves a checkpoint for the converter), PP2xEP2, DP4xEP2 (expert-data-parallel 2), CP2xEP2;
# ep2-swapexperts is the negative control.
MOE_LAUNCHES = {
    2: ["ep2", "ep2-swapexperts", "roundtrip:ep2"],
    4: [
        "ckpt:tp2-ep2-sp",
        "pp2-ep2",
        "dp4-ep2",
        "cp2-ep2",
        "roundtrip:tp2-ep2-sp",
        "initexport:tp2-ep2-sp",
        "roundtrip_per_dp:dp4-ep2",
    ],
}
LOSS_VARIANTS = ["loss_grpo", "loss_dr_grpo", "loss_gspo", "loss_cispo", "loss_sapo"]  # TP1 refs in-process


class Results(str):
    """The output folder (a str) that also knows the model folder."""

    model_dir: str


def make_samples(model_dir, accept=None):
    """8 samples, prompts of 5..19 and responses of 3..27 tokens, old logprobs = TP1 logprobs + noise. `accept(ids)`
    rejects a drawn sample, which is drawn again (the MoE matrix keeps only samples without router ties)."""
    from mgrpo.actor import Actor
    from mgrpo.data.microbatch import make_microbatches

    g = torch.Generator().manual_seed(7)
    samples = []
    for i in range(8):
        p, r = 5 + (i * 5) % 15, 3 + (i * 7) % 25
        while True:
            prompt = torch.randint(3, 300, (p,), generator=g).tolist()
            resp = torch.randint(3, 300, (r,), generator=g).tolist()
            if accept is None or accept(prompt + resp):
                break
        mask = [1] * r
        if i % 3 == 0:
            mask[r // 2] = 0  # an environment-written token inside the response
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=resp,
                loss_mask=mask,
                group_id=i // 4,
                info={"advantage": float(torch.randn((), generator=g))},
            )
        )
    cfg = load_config(argv=["--model.path", model_dir, "--data.path", "unused.jsonl"], check_files=False)
    actor = Actor(cfg, model_dir, train=False)
    for s in samples:
        mb = make_microbatches([s], 1, 0)[0]
        logp = actor.logprobs([mb])[0][0]
        pos = [len(s.prompt_ids) + j - 1 for j in range(len(s.response_ids))]
        noise = 0.3 * torch.randn(len(pos), generator=g)
        s.rollout_logprobs = (logp[pos] + noise).tolist()
    return samples


def run_all_launches(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    model = tiny_dirs("layout_qwen2", family="qwen2", vocab_size=300, num_layers=4, seed=3)
    samples = make_samples(model)
    path = out / "samples.json"
    path.write_bytes(samples_to_bytes(samples))
    ref_cfg = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            str(path),
            "--train.lr",
            "0.01",
            "--train.adam_eps",
            "0.001",
            "--train.micro_batch_size",
            "2",
        ]
    )
    run_layout(ref_cfg, model, samples, str(out), "tp1")
    from mgrpo.loss.presets import PRESETS

    for variant in LOSS_VARIANTS:
        name = variant[len("loss_") :]
        flag = "--algorithm.loss_type" if name in PRESETS else "--algorithm.policy_loss"
        cfg = load_config(
            argv=[
                "--model.path",
                model,
                "--data.path",
                str(path),
                "--train.lr",
                "0.01",
                "--train.adam_eps",
                "0.001",
                "--train.micro_batch_size",
                "2",
                flag,
                name,
            ]
        )
        run_layout(cfg, model, samples, str(out), f"tp1-{variant}")
    topent = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            str(path),
            "--train.lr",
            "0.01",
            "--train.adam_eps",
            "0.001",
            "--train.micro_batch_size",
            "2",
            "--algorithm.top_entropy_quantile",
            "0.3",
        ]
    )
    run_layout(topent, model, samples, str(out), "tp1-topent")
    for k in (2, 4):  # the first of k mini-batches: its own samples, its own aggregation counts
        run_layout(ref_cfg, model, samples[: len(samples) // k], str(out), f"tp1-mb{k}")
    run_export_roundtrip(ref_cfg, model, str(out), "roundtrip-tp1")
    make_peft_adapter(model, str(out / LORA_ADAPTER))
    lora_cfg = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            str(path),
            "--train.lr",
            "0.01",
            "--train.adam_eps",
            "0.001",
            "--train.micro_batch_size",
            "2",
            *LORA_ARGS,
        ]
    )
    run_layout(lora_cfg, model, samples, str(out), "tp1-lora", corrupt=lora_loader(str(out / LORA_ADAPTER)))
    _launch_all(LAUNCHES, model, path, out)
    res = Results(str(out))
    res.model_dir = model
    return res


def make_peft_adapter(model_dir: str, path: str, rank: int = 4, alpha: int = 8, seed: int = 5) -> dict:
    """A PEFT LoRA on all seven linears with B random too (init_lora_weights=False), saved as PEFT keys."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(
        hf,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    tensors = {k.replace(".default", ""): v.detach().contiguous() for k, v in peft.state_dict().items() if "lora_" in k}
    save_file(tensors, path)
    return tensors


def lora_loader(path: str, swap: bool = False):
    """An Actor hook (run_layout's `corrupt`): the adapters from `path`; `swap`: the negative control."""
    from safetensors.torch import load_file

    from mgrpo.models.lora import adapters, load_peft_tensors

    def load(actor):
        load_peft_tensors(actor.models(), load_file(path))
        if swap:
            import torch.distributed as dist
            from megatron.core import parallel_state as mpu

            first = next((a for a in adapters(actor.models()) if a.layer == 0 and a.linear_name == "linear_qkv"), None)
            if first is not None:
                b, group = first.q_proj_B, mpu.get_tensor_model_parallel_group()
                parts = [torch.empty_like(b) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, b.detach().contiguous(), group=group)
                with torch.no_grad():
                    b.copy_(parts[(mpu.get_tensor_model_parallel_rank() + 1) % len(parts)])

    return load


def _launch_all(launches: dict, model: str, samples_path, out) -> None:
    for world, layouts in launches.items():
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={world}",
            f"--master-port={free_port()}",
            WORKER,
            "--model",
            model,
            "--samples",
            str(samples_path),
            "--out",
            str(out),
            "--layouts",
            ",".join(layouts),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
        assert r.returncode == 0, f"world {world} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def moe_model(tiny_dirs):
    """The layout matrix's MoE: 4 layers, layer 2 dense (mlp_only_layers), 8 experts, top-2."""
    return tiny_dirs("layout_qwen3_moe", family="qwen3_moe", vocab_size=300, num_layers=4, mlp_only_layers=(2,), seed=3)


MIN_ROUTER_GAP = 1e-4  # between the k-th and (k+1)-th expert's score; fp32 noise between layouts is ~1e-7


def router_gap(model, ids: list) -> float:
    """The smallest gap between the k-th and (k+1)-th router probability over every token and MoE layer of one
    sequence, by HF's own forward (`model` an HF Qwen3-MoE)."""
    gaps = []

    def hook(module, args, out):
        top = torch.softmax(out[0].float(), -1).topk(module.top_k + 1, -1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def run_moe_launches(tiny_dirs, tmp_path_factory):
    """The MoE layouts against the EP1 (TP1) run in this process, plus the HF -> megatron -> HF round trips. Samples
    whose routing has a near-tie (top-k gap below MIN_ROUTER_GAP) are drawn again, so no layout's float noise can
    flip an expert choice."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("moe_layouts")
    model = moe_model(tiny_dirs)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    samples = make_samples(model, accept=lambda ids: router_gap(hf, ids) > MIN_ROUTER_GAP)
    path = out / "samples.json"
    path.write_bytes(samples_to_bytes(samples))
    ref_cfg = load_config(
        argv=[
            "--model.path",
            model,
            "--data.path",
            str(path),
            "--train.lr",
            "0.01",
            "--train.adam_eps",
            "0.001",
            "--train.micro_batch_size",
            "2",
        ]
    )
    run_layout(ref_cfg, model, samples, str(out), "tp1")
    run_export_roundtrip(ref_cfg, model, str(out), "roundtrip-tp1")
    _launch_all(MOE_LAUNCHES, model, path, out)
    res = Results(str(out))
    res.model_dir = model
    res.samples = samples
    return res
