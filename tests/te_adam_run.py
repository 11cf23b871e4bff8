"""Run launch/train_grpo.py with megatron-core taking TransformerEngine's optimizer branch, on CPU.

TE cannot import here, so megatron's module flags are set as its `try: import transformer_engine` would set them
and its `Adam` is `TELayoutAdam`: TE's FusedAdam state layout (transformer_engine/pytorch/optimizers/fused_adam.py,
v2.4-2.10: the step an int in each param group, set to 1 by the first `step()`; per parameter exactly `exp_avg` and
`exp_avg_sq` in fp32, created in `step()`; `state_dict` / `load_state_dict` look every state key up in a
name-to-dtype table, so an unknown key is a KeyError) with torch's AdamW arithmetic (TE's `adam_w_mode=True`).
Everything else, megatron's DistributedOptimizer save and load included, is megatron's own code.

    python tests/te_adam_run.py ARGS...   (the launcher's arguments)
"""

import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TELayoutAdam(torch.optim.Optimizer):
    steps = 0  # step() calls in this process: the run really took this optimizer

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        **_,
    ):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}

    @torch.no_grad()
    def step(self, closure=None):
        TELayoutAdam.steps += 1
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            (b1, b2), step, wd = group["betas"], group["step"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if p.grad is None:
                    continue
                g = p.grad if self.adam_w_mode or not wd else p.grad + wd * p
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1, c2 = (1 - b1**step, 1 - b2**step) if group["bias_correction"] else (1.0, 1.0)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode and wd:
                    update = update + wd * p
                p.add_(update, alpha=-group["lr"])

    def _check_keys(self, state_dict):
        for state in state_dict["state"].values():
            for key in state:
                self.name_to_dtype_map[key]  # TE: KeyError for a key it does not keep

    def state_dict(self):
        out = super().state_dict()
        self._check_keys(out)
        return out

    def load_state_dict(self, state_dict):
        self._check_keys(state_dict)
        super().load_state_dict(state_dict)


def install() -> None:
    import megatron.core.optimizer as opt
    from megatron.core.optimizer import distrib_optimizer as dopt

    opt.Adam, opt.USING_PYTORCH_OPTIMIZER = TELayoutAdam, False
    dopt.Adam, dopt.HAVE_APEX_OR_TE, dopt.USING_TE_OPTIMIZER = TELayoutAdam, True, True


if __name__ == "__main__":
    import atexit

    install()
    atexit.register(lambda: print(f"TELayoutAdam steps: {TELayoutAdam.steps}", file=sys.stderr, flush=True))
    launcher = os.path.join(ROOT, "launch", "train_grpo.py")
    sys.argv = [launcher, *sys.argv[1:]]
    runpy.run_path(launcher, run_name="__main__")
