"""RMSNorm for megatron's local spec that, unlike `WrappedTorchNorm`, allows sequence parallelism.

Under SP each TP rank normalises a different slice of the sequence, so the weight's gradient is a
partial sum; marking `weight.sequence_parallel` makes megatron's finalize_model_grads all-reduce it
over TP. q/k norms see different heads per TP rank and megatron reduces those by name instead.
"""
import torch


class SPRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        # Compute in fp32 like HF's Qwen2RMSNorm/LlamaRMSNorm, then cast back.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class QKRMSNorm(SPRMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps)
        setattr(self.weight, "sequence_parallel", False)
