"""`model.moe`: the mixture-of-experts training options. They live with the model builder that reads them
(models/builder.py); mgrpo/config.py re-exports the class as part of the run's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class MoeConfig:
    """Mixture-of-experts options (used only when the model has experts)."""

    aux_loss_coeff: float = 0.0  # megatron's load-balancing loss in the training loss; 0 = off (RL default)
    z_loss_coeff: float = 0.0  # router z-loss; 0 = off
    token_dispatcher: str = "auto"  # auto (= alltoall) | alltoall | allgather (needs equal tokens per EP rank)
    grouped_gemm: Optional[bool] = None  # TE's grouped-GEMM experts, not a loop; null: on a GPU with TransformerEngine
