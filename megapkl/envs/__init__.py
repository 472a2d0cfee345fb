"""What a multi-turn trajectory talks to between the policy's turns (docs/agents.md).

`base`: the environment interface (`Environment.step(turn) -> Observation | End`); `lookup`: the
tool of the CPU toy task lookup_kv; `python`: a user's environment, run as a user's reward is.
`build_turn_driver` makes the `megapkl.rollout.turns.TurnDriver` an engine generates with from
the env section.
"""
from __future__ import annotations

from typing import Any, Optional


def build_env(env: Any, task: Any = None):
    """The environment of the env section (`megapkl.config.sections_env.EnvConfig`); `task`: the
    synthetic task (type lookup)."""
    if env.type == "lookup":
        from megapkl.envs.lookup import LookupEnv

        if task is None or getattr(task, "name", None) != "lookup_kv":
            raise ValueError("env.type lookup needs data.synthetic: lookup_kv")
        return LookupEnv(task)
    if env.type == "python":
        from megapkl.envs.python import PythonEnv

        return PythonEnv(env.function, timeout_s=env.timeout_s, workers=env.workers,
                         stop=env.stop)
    raise ValueError(f"env.type: unknown {env.type!r}")


def build_turn_driver(env: Any, max_response_len: int, tokenizer: Any, task: Any = None
                      ) -> Optional[Any]:
    """The engine's `TurnDriver` for the env section, or None when responses are single-turn
    (env.type unset). `max_response_len`: rollout.max_response_len, the response budget."""
    if not env.multi_turn:
        return None
    from megapkl.rollout.turns import Budgets, TurnDriver

    environment = build_env(env, task)
    if env.stop is not None:
        environment.stop = tuple(env.stop)
    budgets = Budgets(max_turns=env.max_turns, max_response_tokens=max_response_len,
                      max_turn_tokens=env.max_turn_tokens,
                      max_observation_tokens=env.max_observation_tokens)
    return TurnDriver(environment, tokenizer, budgets, timeout_s=env.timeout_s,
                      on_error=env.on_error, concurrency=env.concurrency)
