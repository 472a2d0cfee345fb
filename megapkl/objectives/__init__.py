"""Policy objectives of SPEC.md: pure torch math, no torch.distributed, no megatron."""
from megapkl.config.objective import ObjectiveConfig as PolicyLossConfig
from megapkl.objectives.batch import LossOutput, TokenBatch

__all__ = ["PolicyLossConfig", "TokenBatch", "LossOutput"]
