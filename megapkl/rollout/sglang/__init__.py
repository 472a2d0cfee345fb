"""SGLang rollouts: the engine client, weight sync, server fleet and launcher (see docs/engines.md).

Only the standard library and torch are needed on the client side; SGLang and sglang-router are
needed only where megapkl launches them."""
from megapkl.rollout.sglang.client import SGLangEngine
from megapkl.rollout.sglang.fleet import EnginesUnavailable, Fleet, HealthSettings, Held, Worker
from megapkl.rollout.sglang.launch import ServerLaunchError
from megapkl.rollout.sglang.protocol import (GENERATE_FIELDS, REQUEST_FIELDS, ROUTES,
                                             SAMPLING_FIELDS, ProtocolError)
from megapkl.rollout.sglang.weight_state import WeightState
from megapkl.rollout.sglang.weights import SyncSettings, Target, WeightSync

__all__ = ["SGLangEngine", "EnginesUnavailable", "Fleet", "HealthSettings", "Held", "Worker",
           "WeightState", "ServerLaunchError",
           "ROUTES", "GENERATE_FIELDS", "SAMPLING_FIELDS", "REQUEST_FIELDS", "ProtocolError",
           "SyncSettings", "Target", "WeightSync"]
