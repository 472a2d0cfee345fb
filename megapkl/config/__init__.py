"""Typed run configuration: dataclass sections loaded from YAML with strict validation.

    from megapkl.config import load_config, dump_config
    cfg = load_config("configs/objectives/grpo.yaml", ["train.lr=5e-6"])

Imports nothing of megapkl beyond this package and no torch (docs/architecture.md: config is the
first layer), so `megapkl config show` stays fast.
"""
from megapkl.config.loader import (config_from_dict, dump_config, load_config, loads_config,
                                   merged_mapping, parse_override)
from megapkl.config.objective import OBJECTIVE_NAMES, ObjectiveConfig, SISConfig
from megapkl.config.run import RunConfig
from megapkl.config.sections import (AdvantageConfig, ModelConfig, ParallelConfig, ReferenceConfig,
                                     RolloutConfig, SGLangConfig)
from megapkl.config.sections_train import (BenchmarkConfig, CheckpointConfig, DataConfig,
                                           EvalConfig, LoggingConfig, RewardConfig, SlurmConfig,
                                           TrainConfig)
from megapkl.config.shipped import configs_dir
from megapkl.config.typed import ConfigError

__all__ = [
    "ConfigError", "ObjectiveConfig", "SISConfig", "OBJECTIVE_NAMES",
    "RunConfig", "ModelConfig", "ParallelConfig", "AdvantageConfig", "ReferenceConfig",
    "RolloutConfig", "SGLangConfig", "TrainConfig", "DataConfig", "RewardConfig", "EvalConfig",
    "BenchmarkConfig", "LoggingConfig", "CheckpointConfig", "SlurmConfig",
    "load_config", "loads_config", "config_from_dict", "merged_mapping", "dump_config",
    "parse_override", "configs_dir",
]
