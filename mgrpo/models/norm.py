"""RMSNorm for megatron's local spec that, unlike `WrappedTorchNorm`, allows sequence parallelism.

Under SP each TP rank normalises a different slice of the sequence, so the weight's gradient is a
partial sum; marking `weight.sequence_parallel` makes megatron's finalize_model_grads all-reduce it
over TP. q/k norms see different heads per TP rank and megatron reduces those by name instead.
"""

import torch


def init_device(config):
    """Where megatron puts a module's parameters at construction: the default device with
    use_cpu_initialization, else `torch.cuda.current_device()` (as its own linears and embeddings do;
    megatron-core never moves a built model, so a norm left on the CPU would meet GPU activations in the first
    forward)."""
    return None if config.use_cpu_initialization else torch.cuda.current_device()  # None: the default device
    # (the CPU, or meta under `with torch.device("meta")` when --print-plan builds a 72B model to count it)


class SPRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=init_device(config))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x):
        # Compute in fp32 like HF's Qwen2RMSNorm/LlamaRMSNorm (float64 stays float64), then cast back.
        dtype = x.dtype
        xf = x if dtype == torch.float64 else x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class QKRMSNorm(SPRMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps)
        setattr(self.weight, "sequence_parallel", False)
