"""Typed run configuration: dataclass sections loaded from YAML with strict validation."""
from megapkl.config.objective import OBJECTIVE_NAMES, ObjectiveConfig, SISConfig
from megapkl.config.typed import ConfigError

__all__ = ["ConfigError", "ObjectiveConfig", "SISConfig", "OBJECTIVE_NAMES"]
