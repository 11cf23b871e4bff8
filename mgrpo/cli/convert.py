"""Convert an mgrpo checkpoint (saved at any TP/PP/VPP layout) into an HF model folder.

    mgrpo-convert --checkpoint runs/x/checkpoints/step_000100 --output hf_out
    mgrpo-convert --checkpoint CKPT --output hf_out --dtype bfloat16 --max-shard-size 5GB --overwrite [--peft]

(`python launch/convert_to_hf.py ...` from a checkout is the same command.)

A LoRA run's checkpoint converts to the base with the adapters merged in (B·A·alpha/rank, tensor by tensor), or
with --peft to a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the HF base.

One CPU process; tensors stream one by one from megatron to safetensors shards with a progress bar.
The output is written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import os
import sys
import warnings

from mgrpo.cli.dialect import FlagParser

# megatron-core warns at import about every optional kernel package it does not find (Apex, TE, ...)
warnings.filterwarnings("ignore", module=r"megatron\.")


def parse_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "5GiB" (transformers' `convert_file_size_to_int`, the units of HF's
    `max_shard_size`) or a plain byte count; ValueError with the fix for anything else."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = int(text) if str(text).strip().isdigit() else convert_file_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(
            f"--max-shard-size {text!r}: use a positive size such as 5GB, 500MB or 5GiB (HF's units), "
            f"or a number of bytes"
        )
    return size


def convert(
    checkpoint: str,
    output: str,
    dtype=None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    peft: bool = False,
):
    from tqdm import tqdm

    from mgrpo.checkpoint import CheckpointFolderError, load_checkpoint, read_meta
    from mgrpo.config import ParallelConfig
    from mgrpo.models.builder import build_model
    from mgrpo.parallel.distributed import init_distributed
    from mgrpo.parallel.state import setup_model_parallel
    from mgrpo.weights.export import export_hf
    from mgrpo.weights.hf_writer import check_output_dir, write_hf_folder

    meta = read_meta(checkpoint)
    check_output_dir(output, overwrite)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(k, None)
    init_distributed(backend="gloo")
    parallel = ParallelConfig()
    setup_model_parallel(parallel)
    hf_dir = os.path.join(checkpoint, "hf")
    chunks = build_model(hf_dir, parallel, params_dtype=meta.get("params_dtype", "float32"), use_te=False)
    if meta.get("lora"):  # the adapters' modules first; their values come from the checkpoint
        from mgrpo.config import LoraConfig
        from mgrpo.models.lora import apply_lora

        apply_lora(chunks, LoraConfig(**meta["lora"]), seed=0)
    elif peft:
        raise CheckpointFolderError(f"--peft: {checkpoint} is not a LoRA run's checkpoint (no adapters); drop --peft")
    load_checkpoint(chunks, checkpoint)
    if peft:
        from mgrpo.config import LoraConfig
        from mgrpo.models.lora import peft_config, peft_tensors
        from mgrpo.weights.hf_writer import write_peft_folder

        return write_peft_folder(
            peft_tensors(chunks), output, peft_config(LoraConfig(**meta["lora"]), hf_dir), overwrite
        )
    total = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    info, emb = chunks[0].mgrpo_info, chunks[0].embedding.word_embeddings.weight
    total -= (
        (chunks[0].vocab_size - info.vocab_size)
        * emb[0].numel()
        * emb.element_size()
        * (1 if info.tie_word_embeddings else 2)
    )  # padded vocabulary rows are not exported
    with tqdm(total=total, unit="B", unit_scale=True, desc="convert", file=sys.stderr) as bar:
        write_hf_folder(
            export_hf(chunks, dst=0, bucket_bytes=64 << 20),
            output,
            hf_dir,
            max_shard_bytes,
            dtype,
            overwrite,
            progress=bar,
        )
    return output


def main(argv=None) -> int:
    ap = FlagParser("mgrpo-convert", __doc__)
    ap.add_argument("--checkpoint", required=True, help="a step_XXXXXX folder written by the trainer")
    ap.add_argument("--output", required=True, help="HF folder to write")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard: 5GB, 500MB, 5GiB or bytes")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--peft", action="store_true", help="a LoRA checkpoint's adapters as a PEFT folder (not merged)")
    args = ap.parse_args(argv)
    try:  # before megatron is imported: a bad value answers at once
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from mgrpo.checkpoint import CheckpointFolderError
    from mgrpo.weights.hf_writer import OutputExistsError

    try:
        out = convert(args.checkpoint, args.output, args.dtype, max_shard_bytes, args.overwrite, args.peft)
    except (CheckpointFolderError, OutputExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
