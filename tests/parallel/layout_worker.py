"""torchrun worker: run several layouts in one launch (a launch costs 7-11 s here) and save results."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: layout_launch

from layout_check import run_export_roundtrip, run_init_export, run_layout, run_nan_step  # noqa: E402
from layout_launch import LORA_ADAPTER, LORA_ARGS, lora_loader  # noqa: E402

from mgrpo.config import load_config  # noqa: E402
from mgrpo.parallel.distributed import init_distributed  # noqa: E402
from mgrpo.rollout.types import samples_from_bytes  # noqa: E402

GLOBAL_BATCH, MICRO_BATCHES = 8, 4


def layout_args(spec: str) -> list:
    """'tp2-pp2-vpp2-sp-distopt-p2pbatch' -> config flags."""
    args = []
    for part in spec.split("-"):
        if part == "sp":
            args += ["--parallel.sp", "true"]
        elif part == "distopt":
            args += ["--train.use_distributed_optimizer", "true"]
        elif part == "p2pbatch":
            args += ["--parallel.batch_p2p_comm", "true"]
        elif part.startswith("loss_"):
            from mgrpo.loss.presets import PRESETS

            name = part[len("loss_") :]
            args += ["--algorithm.loss_type" if name in PRESETS else "--algorithm.policy_loss", name]
        elif part == "topent":  # the top-entropy token mask, 30% of the tokens
            args += ["--algorithm.top_entropy_quantile", "0.3"]
        elif part == "pack":
            args += ["--train.sequence_packing", "true"]
        elif part.startswith("budget"):
            args += ["--train.max_tokens_per_microbatch", part[len("budget") :]]
        elif part in (
            "wrongshard",
            "localseq",
            "nozigzag",
            "nogloo",
            "rankq",
            "swapexperts",
            "loraswap",
            "crossattn",
        ) or part.startswith("dp"):
            continue  # DP is what the world size leaves over
        else:
            name = part.rstrip("0123456789")
            args += [f"--parallel.{name}", part[len(name) :]]
    return args


def swap_proj_shards(actor):
    """Negative control: every TP rank holds another rank's shard of layer 0's attention output projection."""
    from megatron.core import parallel_state as mpu

    from mgrpo.parallel.pipeline import unwrap

    model = unwrap(actor.chunks[0])
    if not model.pre_process:
        return
    w = model.decoder.layers[0].self_attention.linear_proj.weight
    group = mpu.get_tensor_model_parallel_group()
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, w.detach().contiguous(), group=group)
    with torch.no_grad():
        w.copy_(parts[(mpu.get_tensor_model_parallel_rank() + 1) % len(parts)])


def swap_ep_experts(actor):
    """Negative control: every EP rank holds another EP rank's first expert of the first MoE layer."""
    from megatron.core import parallel_state as mpu

    from mgrpo.parallel.pipeline import unwrap

    layers = [layer for c in actor.chunks for layer in unwrap(c).decoder.layers if hasattr(layer.mlp, "router")]
    w = layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    group = mpu.get_expert_model_parallel_group()
    parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, w.detach().contiguous(), group=group)
    with torch.no_grad():
        w.copy_(parts[(mpu.get_expert_model_parallel_rank() + 1) % len(parts)])


def per_rank_seq_sum(actor):
    """Negative control: sequence-level ratios reduced per CP rank instead of across the CP group."""
    actor.seq_sum = lambda x: x.sum(-1)


def contiguous_cp_split(actor):
    """Negative control: contiguous CP chunks while attention and RoPE assume megatron's zigzag layout."""
    import mgrpo.parallel.context_parallel as cp

    def contiguous(seq_len, cp_rank, cp_size, device=None):
        n = seq_len // cp_size
        return torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)

    cp.zigzag_indices = contiguous  # split_for_cp looks it up at call time; the attention keeps its own copy


def attention_across_samples(actor):
    """Negative control: this actor's CP attention ignores the packed row's segments (queries see earlier samples)."""
    from mgrpo.models.cp_attention import CPDotProductAttention, attend_within

    def blind(forward):
        def run(*args, **kwargs):
            with attend_within(None):
                return forward(*args, **kwargs)

        return run

    for model in actor.models():
        for module in model.modules():
            if isinstance(module, CPDotProductAttention):
                module.forward = blind(module.forward)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--samples", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", required=True, help="comma-separated, e.g. tp2,tp2-sp,pp2-vpp2")
    args = ap.parse_args()
    init_distributed()
    with open(args.samples, "rb") as f:
        samples = samples_from_bytes(f.read())
    for spec in args.layouts.split(","):
        mode, _, layout = spec.rpartition(":")
        flags = layout_args(layout)
        lora = LORA_ARGS if mode == "lora" else []
        cfg = load_config(
            argv=[
                "--model.path",
                args.model,
                "--data.path",
                args.samples,
                "--train.lr",
                "0.01",
                "--train.adam_eps",
                "0.001",
                *flags,
                *lora,
            ],
            check_files=False,
        )
        world = dist.get_world_size()
        dp = world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
        cfg.train.micro_batch_size = max(1, GLOBAL_BATCH // dp // MICRO_BATCHES)
        if mode in ("roundtrip", "roundtrip_per_dp"):
            run_export_roundtrip(cfg, args.model, args.out, spec.replace(":", "-"), per_dp=mode == "roundtrip_per_dp")
        elif mode in ("mb2", "mb4"):  # the first mini-batch of a generation batch split in 2 or 4
            run_layout(cfg, args.model, samples[: len(samples) // int(mode[2:])], args.out, f"{mode}-{layout}")
        elif mode in ("nanstep", "nanstep_noguard"):
            run_nan_step(cfg, args.model, samples, args.out, spec.replace(":", "-"), guard=mode == "nanstep")
        elif mode == "initexport":
            ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(11))
            run_init_export(cfg, args.model, args.out, spec.replace(":", "-"), ids)
        else:
            corrupt = {
                "wrongshard": swap_proj_shards,
                "localseq": per_rank_seq_sum,
                "nozigzag": contiguous_cp_split,
                "swapexperts": swap_ep_experts,
                "crossattn": attention_across_samples,
            }.get(spec.rpartition("-")[2])
            if mode == "lora":
                corrupt = lora_loader(os.path.join(args.out, LORA_ADAPTER), swap="loraswap" in layout.split("-"))
            save_to = os.path.join(args.out, "ckpt-" + spec) if mode == "ckpt" else None
            gloo = False if "nogloo" in layout.split("-") else None  # megatron's groups as under nccl
            tag = f"lora-{layout}" if mode == "lora" else layout
            run_layout(
                cfg,
                args.model,
                samples,
                args.out,
                tag,
                corrupt=corrupt,
                save_to=save_to,
                gloo_groups=gloo,
                entropy_per_rank="rankq" in layout.split("-"),
            )
        if dist.get_rank() == 0:
            print(f"layout {spec} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
