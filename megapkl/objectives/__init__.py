"""Policy objectives of docs/spec.md: pure torch math, no torch.distributed, no megatron.

    from megapkl.objectives import PolicyLossConfig, TokenBatch, policy_loss
    out = policy_loss(PolicyLossConfig.from_dict({"name": "proximal_kl"}), batch)
"""
from megapkl.config.objective import ObjectiveConfig as PolicyLossConfig
from megapkl.objectives.advantages import compute_advantages
from megapkl.objectives.batch import LossOutput, TokenBatch
from megapkl.objectives.loss import policy_loss
from megapkl.objectives.registry import OBJECTIVES, get_objective

__all__ = ["PolicyLossConfig", "TokenBatch", "LossOutput", "policy_loss", "compute_advantages",
           "OBJECTIVES", "get_objective"]
