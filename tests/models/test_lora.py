"""LoRA at TP1 against HF + PEFT (fp32): the forward with the same adapters (every target subset the fused megatron
linears must handle), the base with adapters off, the merged export against PEFT's merge_and_unload, PEFT names
round trip, the trainable count against PEFT's, and the config's refusals."""

import os

import pytest
import torch

from mgrpo.config import LoraConfig, ParallelConfig
from mgrpo.models.builder import build_model
from mgrpo.models.forward import full_logits
from mgrpo.models.lora import adapters, adapters_disabled, apply_lora, load_peft_tensors, peft_tensors, trainable_count
from mgrpo.weights.export import export_hf
from mgrpo.weights.load import load_hf

TOL = 1e-5
SUBSETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
    "k_up_down": ["k_proj", "up_proj", "down_proj"],
}


def _peft(model_dir, targets, seed=0):
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(hf, PeftConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)).eval()
    tensors = {k.replace(".default", ""): v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return model, tensors


def _megatron(model_dir, targets, tensors):
    chunks = build_model(model_dir, ParallelConfig(), use_te=False)
    load_hf(chunks, model_dir)
    apply_lora(chunks, LoraConfig(rank=4, alpha=8, target_modules=targets), seed=1)
    load_peft_tensors(chunks, tensors)
    return chunks


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs("lora_qwen2", family="qwen2", vocab_size=300, num_layers=2)


@pytest.mark.parametrize("subset", sorted(SUBSETS))
def test_forward_equals_hf_peft(single_rank, model_dir, subset):
    targets = SUBSETS[subset]
    peft, tensors = _peft(model_dir, targets)
    chunks = _megatron(model_dir, targets, tensors)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = peft(ids).logits
        with peft.disable_adapter():
            base_ref = peft(ids).logits
    got = full_logits(chunks[0], ids)[..., :300]
    with adapters_disabled(chunks):
        base = full_logits(chunks[0], ids)[..., :300]
    print(
        f"{subset}: max |d| {float((got - ref).abs().max()):.2e}, adapters move logits by "
        f"{float((ref - base_ref).abs().max()):.2e}"
    )
    assert (got - ref).abs().max() <= TOL and (base - base_ref).abs().max() <= TOL
    assert (ref - base_ref).abs().max() > 1e-2, "the adapters must matter, or the test proves nothing"
    merged = {n: t.clone() for n, t in export_hf(chunks)}
    want = peft.merge_and_unload().state_dict()
    assert max(float((merged[n] - want[n]).abs().max()) for n in merged) <= 1e-6
    back = dict(peft_tensors(chunks))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in back)


def test_negative_control_swapped_q_and_k_factors(single_rank, model_dir):
    """Layer 0's k_proj and v_proj factors (same shapes) loaded into each other's place fail the same comparison:
    the QKV interleave must put each part where megatron's fused layout has it."""
    targets = SUBSETS["all"]
    peft, tensors = _peft(model_dir, targets)
    swapped = dict(tensors)
    for f in ("A", "B"):
        k, v = (f"base_model.model.model.layers.0.self_attn.{m}.lora_{f}.weight" for m in ("k_proj", "v_proj"))
        swapped[k], swapped[v] = tensors[v], tensors[k]
    chunks = _megatron(model_dir, targets, swapped)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = peft(ids).logits
    assert (full_logits(chunks[0], ids)[..., :300] - ref).abs().max() > TOL


def test_only_adapters_train_and_count_equals_peft(single_rank, model_dir):
    from mgrpo.models.hf_config import read_model_info

    for name, targets in SUBSETS.items():
        peft, _ = _peft(model_dir, targets)
        chunks = _megatron(model_dir, targets, dict(peft_tensors_of(peft)))
        trainable = [n for n, p in chunks[0].named_parameters() if p.requires_grad]
        assert trainable and all("_lora." in n for n in trainable)
        ours = sum(p.numel() for a in adapters(chunks) for p in a.parameters())
        peft_count = sum(p.numel() for p in peft.parameters() if p.requires_grad)
        lora = LoraConfig(rank=4, alpha=8, target_modules=targets)
        assert ours == peft_count == trainable_count(read_model_info(model_dir), lora), name


def peft_tensors_of(peft):
    return ((k.replace(".default", ""), v.detach()) for k, v in peft.state_dict().items() if "lora_" in k)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.lora.rank", "-1"], "model.lora.rank=-1 must be an integer >= 0"),
        (["--model.lora.rank", "4", "--model.lora.alpha", "0"], "model.lora.alpha"),
        (["--model.lora.rank", "4", "--model.lora.dropout", "1.5"], "model.lora.dropout"),
        (["--model.lora.rank", "4", "--model.lora.target_modules", "[q_proj, qkv]"], "unknown module 'qkv'"),
        (
            ["--model.lora.rank", "4", "--rollout.lora_sync", "adapter"],
            "rollout.lora_sync=adapter with rollout.engine=hf",
        ),
        (["--rollout.lora_sync", "both"], "rollout.lora_sync='both'"),
    ],
)
def test_bad_lora_config_is_one_clear_line(argv, message):
    from mgrpo.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(argv=["--model.path", "x", "--data.path", "y.jsonl", *argv], check_files=False)
    assert message in str(err.value)


def test_rank_above_the_smallest_dimension_is_refused(model_dir):
    from mgrpo.layout_checks import lora_layout_problems
    from mgrpo.models.hf_config import read_model_info

    info = read_model_info(model_dir)
    assert lora_layout_problems(LoraConfig(rank=4), info) == []
    assert "exceeds the smallest adapted dimension" in lora_layout_problems(LoraConfig(rank=10_000), info)[0]


def test_lora_takes_transformer_engines_core_attention_where_it_imports(monkeypatch):
    """On a GPU, LoRA's layers keep megatron's own linears (the adapters wrap them) and take TE's fused core
    attention, which keeps no score matrices (what --print-plan counts for LoRA); packing and CP keep our core
    attention, and without the flag the local spec is megatron's own. TE does not import here: a stand-in module
    gives the class its name, and the real one is read on the GPU machine."""
    import sys
    import types

    from megatron.core.models.gpt import gpt_layer_specs  # noqa: F401  (imported before the stand-in exists)
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mgrpo.models.builder import layer_spec, transformer_config
    from mgrpo.models.cp_attention import CPDotProductAttention
    from mgrpo.models.hf_config import read_model_info

    class TEDotProductAttention(DotProductAttention):
        pass

    te = types.ModuleType("megatron.core.extensions.transformer_engine")
    te.TEDotProductAttention = TEDotProductAttention
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", te)
    info = read_model_info(
        os.path.join(os.path.dirname(__file__), "..", "..", "examples", "model_configs", "Qwen2.5-7B-Instruct")
    )
    config = transformer_config(info, ParallelConfig())

    def core(**kw):
        return layer_spec(config, use_te=False, **kw).submodules.self_attention.submodules.core_attention

    assert core(fused_attention=True) is TEDotProductAttention
    assert core(fused_attention=True, packing=True) is CPDotProductAttention
    assert core() is DotProductAttention
