"""Subprocess probe: peak RSS increase while streaming `export_hf` vs holding `list(export_hf(...))`.

Builds a megatron-initialised ~460 MB fp32 model at TP1 and prints one JSON line.
Run with MALLOC_MMAP_THRESHOLD_=131072 so freed buffers go back to the OS and RSS tracks live memory.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mgrpo.config import ParallelConfig  # noqa: E402
from mgrpo.models.builder import build_model  # noqa: E402
from mgrpo.models.hf_config import ModelInfo  # noqa: E402
from mgrpo.parallel.distributed import init_distributed  # noqa: E402
from mgrpo.parallel.state import setup_model_parallel  # noqa: E402
from mgrpo.profiling import MB, PeakRSS  # noqa: E402
from mgrpo.weights.export import export_hf  # noqa: E402


def main():
    bucket = int(sys.argv[1]) * MB if len(sys.argv) > 1 else 32 * MB
    init_distributed(backend="gloo")
    setup_model_parallel(ParallelConfig())
    info = ModelInfo(
        architecture="Qwen2ForCausalLM",
        family="qwen2",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    chunks = build_model(info, ParallelConfig())
    model_mb = sum(p.numel() * p.element_size() for p in chunks[0].parameters()) / MB
    largest_mb = max(p.numel() * p.element_size() for p in chunks[0].parameters()) / MB
    checksum = 0.0
    with PeakRSS() as streamed:
        for _, t in export_hf(chunks, bucket_bytes=bucket):
            checksum += float(t.view(-1)[0])
    with PeakRSS() as held:
        everything = list(export_hf(chunks, bucket_bytes=bucket))
    print(
        json.dumps(
            {
                "model_mb": model_mb,
                "largest_mb": largest_mb,
                "bucket_mb": bucket / MB,
                "streamed_increase_mb": streamed.increase_mb,
                "list_increase_mb": held.increase_mb,
                "tensors": len(everything),
            }
        )
    )


if __name__ == "__main__":
    main()
